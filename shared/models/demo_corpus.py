"""Training text for the demo tokenizer.

It lives in a .py module, not a data file, so every install (editable, wheel, container) ships it
without package-data configuration, and the tokenizer trained on it is the same on every machine.
Plain prose with a little chat, code and non-English text, so common merges look like a real
tokenizer's. Edit it and the demo tokenizer's ids change: every demo checkpoint must be rebuilt.
"""
from __future__ import annotations

TEXT = """\
The Lighthouse Keeper

On the northern edge of the island there was a lighthouse, and in the lighthouse there lived a
keeper named Marta. Every evening, just before the sun went down, she climbed the one hundred and
twelve steps to the lamp room, cleaned the glass, trimmed the wick and lit the great lamp. Every
morning she climbed the same steps again to put it out. She had done this for twenty years, and
she said she had never once been bored, because the sea was never the same sea twice.

In the spring the water was green and restless, and the fishing boats went out before dawn. In
the summer it was blue and calm, and children from the village came to swim in the little bay
below the rocks. In the autumn the storms arrived, one after another, and the waves climbed so
high that the spray reached the windows of the kitchen. In the winter the sea turned grey and
heavy, and on the coldest nights a thin skin of ice formed along the edge of the harbour.

Marta kept a logbook. In it she wrote the weather, the direction of the wind, the ships that
passed and anything else that seemed worth remembering. Some entries were short: "Fog until
noon. Two trawlers returned early." Others went on for pages, because something had happened
that she wanted to understand. She believed that if you wrote a thing down carefully enough, you
would see it more clearly the next time it happened.

One night in November, a small sailing boat came too close to the reef. Its lights were
flickering, and it was turning in slow circles as if the people on board could not decide which
way to go. Marta watched it through the telescope for a long time. Then she went down to the
radio, called the harbour master, and told him exactly where the boat was, how fast the tide was
running, and which passage through the rocks was still safe at that hour. By midnight the boat
was tied up in the harbour, and the two tired sailors were drinking tea in the harbour master's
office. They never learned her name, but she wrote theirs in the logbook.

How Computers Remember

A computer program spends much of its time waiting for data. The processor itself is very fast,
but the main memory is slow by comparison, and the disk is slower still. To hide this gap,
computers use caches: small, fast memories that keep a copy of the data that was used recently,
on the assumption that it will be used again soon. When the data is found in the cache, we call
it a hit; when it is not, we call it a miss, and the program must wait while the data is fetched
from further away.

The idea of a cache appears at every level of a system. The processor has several levels of
cache built into the chip. The operating system keeps recently read pages of files in memory.
A web browser keeps copies of images and scripts it has already downloaded. A database keeps the
most popular rows in a buffer pool. A content delivery network keeps copies of a website on
servers around the world, so that each visitor is served from a machine that is close to them.

Every cache must answer the same questions. What should be stored? How do we find it quickly?
And when the cache is full, which entry should be thrown away to make room for a new one? The
most common answer to the last question is "least recently used": evict the entry that has gone
the longest without being touched. This rule is simple, cheap to implement, and works well when
recent behaviour is a good guide to future behaviour, which it usually is.

Caches are also a source of subtle bugs. If the original data changes and the cached copy does
not, the program will read an old value. This is called a stale cache, and keeping caches
consistent with the data they copy is one of the hard problems of computer science. A common
saying puts it this way: there are only two hard things in computer science, cache invalidation
and naming things.

Serving Language Models

A large language model generates text one token at a time. Each new token depends on all of the
tokens that came before it, so a naive program would repeat an enormous amount of work at every
step. Instead, the model keeps the keys and values it computed for earlier tokens in a key-value
cache, and each step only has to compute the keys and values for the newest token. The cache
grows with the length of the conversation, and for long prompts it can take more memory than the
model's own weights.

Serving systems divide the work into two phases. In the prefill phase the model reads the whole
prompt at once; this is limited by how fast the hardware can do arithmetic. In the decode phase
the model produces one token per step for each request; this is limited by how fast the hardware
can read memory. Because the two phases have such different needs, some systems run them on
different machines and move the cache from one to the other when the prompt has been read.

Many requests begin with the same text: a long system prompt, a shared document, or the earlier
turns of a conversation. If the server remembers the cache for that common prefix, it can skip
the prefill for it entirely, and the user sees the first token much sooner. To make this work,
the cache is split into fixed-size blocks, and each block is named by a hash of its tokens and of
all the tokens before it. Two requests that share a prefix produce the same chain of hashes, so
the server can find the blocks it already has by looking up their names.

Batching is the other great trick. A graphics processor can handle many requests in the time it
takes to handle one, as long as they are grouped together. Continuous batching goes further: new
requests join the batch as soon as there is room, and finished requests leave it at once, so the
hardware is never waiting for the slowest member of a fixed group.

A Short History of Tea

Tea was first drunk in China, where for centuries it was pressed into bricks, roasted, ground and
whisked into hot water. Travelling monks carried it to Japan, where the whisked powder became the
centre of a careful ceremony. Merchants carried it along the trade routes to Central Asia and
Russia, where it was brewed strong in a samovar and diluted with hot water from the urn.

By the seventeenth century tea had reached Europe on the ships of the Dutch and the Portuguese.
At first it was an expensive medicine sold by apothecaries, then a fashionable drink of the court,
and finally, as the price fell, the everyday drink of ordinary people. In Britain it was taken
with milk and sugar; in Morocco with fresh mint; in India with spices, boiled together with milk
into a sweet, warming chai. Today more tea is drunk in the world than any other beverage except
water.

To make a good cup, start with fresh cold water and bring it just to the boil for black tea, or
let it cool a little for green tea. Warm the pot first. Use about one teaspoon of leaves for each
cup, pour on the water, and wait: three to five minutes for black tea, two or three for green.
Taste it before adding anything. If it is bitter, the water was too hot or the leaves steeped too
long; if it is weak, use more leaves rather than waiting longer.

Questions and Answers

User: What is the capital of France?
Assistant: The capital of France is Paris.

User: Can you explain what a hash function is, in one or two sentences?
Assistant: A hash function turns data of any size into a short, fixed-size value. The same input
always gives the same output, and a good hash makes it very unlikely that two different inputs
give the same value.

User: How many days are there in a leap year?
Assistant: A leap year has 366 days. The extra day is added to February, which then has 29 days.

User: Write a haiku about the sea.
Assistant: Grey waves fold and break,
salt wind carries gulls away,
the tide keeps its time.

User: Why is the sky blue?
Assistant: Sunlight contains all colours. When it passes through the air, the short blue
wavelengths are scattered in every direction much more than the long red ones, so when you look
at any part of the sky away from the sun, you see mostly scattered blue light.

User: Please summarise the plot of a story in three sentences.
Assistant: A lighthouse keeper watches the sea from her tower for twenty years. One stormy night
she sees a lost boat drifting toward the reef and guides it to safety by radio. The sailors never
learn her name, but she writes theirs in her logbook.

User: Thank you, that was helpful!
Assistant: You are welcome. Let me know if there is anything else I can help you with.

The Garden in the Four Seasons

In March the garden looks empty, but the soil is already warming. The first shoots of the
crocuses push through the cold ground, and the buds on the apple tree begin to swell. This is
the time to clear away dead leaves, to prune the roses, and to sow the first seeds indoors on a
sunny windowsill: tomatoes, peppers, basil and sweet peas.

In May everything happens at once. The tulips open, the lilac fills the air with its scent, and
the weeds grow faster than anyone can pull them. The seedlings are planted out after the last
frost, watered every evening and protected from the slugs, who have their own plans for them.

By August the garden is heavy with fruit. There are more courgettes than any family can eat, and
the neighbours begin to find them left quietly on their doorsteps. The beans climb to the top of
their poles, the sunflowers turn their faces to follow the light, and the bees work from morning
until dusk.

In November the garden rests. The last apples are picked and stored in a cool, dark shed, the
beds are covered with compost, and the tools are cleaned, oiled and hung up for the winter. The
gardener sits by the window with a catalogue of seeds and begins, already, to plan next year.

On Learning a Language

Learning a new language as an adult is slow, humbling and deeply rewarding. At the beginning you
can say almost nothing, and every conversation feels like a test you are failing. Then, one day,
you realise that you have understood a joke, or a song on the radio, or an overheard remark on
the train, and you feel as if a door has opened onto a room you did not know was there.

Good learners are patient with themselves. They listen a great deal before they speak, they
repeat useful phrases until those phrases become automatic, and they are not afraid to make
mistakes in front of other people. They read simple books with pleasure instead of difficult
books with a dictionary. Most of all, they find reasons to use the language every day, because
a little practice each day is worth far more than a long lesson once a week.

A few greetings from around the world: bonjour, guten Tag, buenos días, buongiorno, olá, привет,
こんにちは, 你好, 안녕하세요, مرحبا, שלום, γειά σου, merhaba, hallå, cześć, xin chào, namaste.
Words that travel well: café, naïve, résumé, façade, jalapeño, Zürich, São Paulo, Kraków, Ørsted.
Prices and symbols: 10 €, 25 £, 3000 ¥, 42 °C, 5 × 7 = 35, π ≈ 3.14159, ½ cup, — and “quotes”.

Notes on Writing Clear Code

Good code is written for the next person who reads it, and that person is often you, six months
later, having forgotten everything. Choose names that say what a thing is, not how it was built.
Keep functions short enough that their purpose fits in a single sentence. Write a comment when
the reason for a choice is not obvious from the code itself, and let the code speak for itself
when it can.

Tests are a form of documentation that cannot go out of date without someone noticing. A good
test is small, fast and precise: it sets up one situation, performs one action, and checks one
result. When a test fails, its name and its message should tell you what went wrong before you
open the file.

Here is a small example in Python:

def mean(values: list[float]) -> float:
    # An empty list has no mean; say so instead of dividing by zero.
    if not values:
        raise ValueError("mean() of an empty list")
    return sum(values) / len(values)


class Counter:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, word: str) -> None:
        self.counts[word] = self.counts.get(word, 0) + 1

    def most_common(self, n: int = 10) -> list[tuple[str, int]]:
        return sorted(self.counts.items(), key=lambda item: -item[1])[:n]


for i in range(10):
    print(f"{i} squared is {i * i}")

And the same idea as a shell command and a JSON record:

$ cat words.txt | tr -s ' ' '_' | sort | uniq -c | sort -rn | head -n 10
{"id": 42, "name": "example", "tags": ["demo", "test"], "score": 0.75, "active": true}

Numbers, Dates and Times

The meeting is on Tuesday, 14 March 2023, at 09:30. The train leaves at 17:45 from platform 6
and arrives at 21:10. The report covers the years 1998 to 2024, a period of 26 years. The
population of the town grew from 12,500 to 18,750, an increase of 50 percent. The recipe serves
4 people and takes 45 minutes; double the quantities for 8. The temperature fell from 21 degrees
in the afternoon to 7 degrees at night. One kilometre is 1000 metres; one mile is about 1.609
kilometres. There are 60 seconds in a minute, 60 minutes in an hour, 24 hours in a day, 7 days in
a week, and 52 weeks and one or two days in a year.

The Fox and the Crow

A crow found a piece of cheese and flew up into a tree to eat it. A fox, passing below, saw the
cheese and wanted it for himself. "Good morning, beautiful bird," he called. "What shining
feathers you have, and what bright eyes! Surely a bird so fine must have the loveliest voice in
the forest. Will you not sing for me, just once?" The crow, pleased by the praise, opened her beak
to sing, and the cheese fell straight into the fox's mouth. "Thank you," said the fox, as he
trotted away. "Your voice is very fine, but your judgement could be better." The moral: do not
trust those who flatter you.

The Tortoise and the Hare

A hare laughed at a tortoise for being so slow, and the tortoise challenged him to a race. The
hare ran far ahead, and then, sure of winning, lay down under a tree to sleep. The tortoise kept
walking, slowly and steadily, all through the afternoon. When the hare woke up, the tortoise was
already crossing the finish line. Slow and steady wins the race.

Letters

Dear Anna,

Thank you for your letter, which arrived on Monday after a long journey. I am glad to hear that
the new house is warm and that the children have settled into their school. We have had a great
deal of rain here, and the river is higher than I have ever seen it, but the bridge is still
open and the shops are busy. Your father sends his love and asks whether you will come for the
holidays. Please write again soon and tell us all your news.

With love,
Margaret

Dear Sir or Madam,

I am writing to ask about the position of assistant librarian advertised on your website. I have
worked for five years in a public library, where I was responsible for the children's section,
the catalogue and the weekly reading group. I enclose my curriculum vitae and would be happy to
provide references. I look forward to hearing from you.

Yours faithfully,
Thomas Green

Weather Report

Tomorrow will begin cloudy across most of the country, with patchy rain in the west spreading
slowly eastward during the morning. The afternoon should be brighter, with sunny spells and a few
scattered showers, some of them heavy. Winds will be light to moderate from the south-west,
becoming strong near the coast. Highest temperatures will be between twelve and sixteen degrees.
Overnight, skies will clear and temperatures will fall to around four degrees, with a risk of
frost in sheltered valleys. The weekend looks settled and dry, but colder.

The City at Night

After midnight the city changes. The offices are dark, the traffic thins to a few taxis and night
buses, and the streets belong to the people who keep everything running while everyone else is
asleep: the bakers, the nurses, the cleaners, the drivers, the security guards, the engineers who
repair the rails and the water mains. Their work is mostly invisible, and it is noticed only on
the rare mornings when something has gone wrong.

At four o'clock the first deliveries arrive at the markets. Fish comes in from the coast packed
in ice, vegetables come in from the farms still cold from the fields, and flowers come in from
the airport, flown from the other side of the world. By six the cafés open their shutters, and
by seven the city is awake again, crowded and loud, as if the night had never happened.

A Few Proverbs

Many hands make light work. Actions speak louder than words. A journey of a thousand miles begins
with a single step. Do not count your chickens before they hatch. Where there is a will, there is
a way. Better late than never. The early bird catches the worm. When in Rome, do as the Romans do.
You cannot judge a book by its cover. Practice makes perfect. Every cloud has a silver lining.
Two heads are better than one. Still waters run deep. Time and tide wait for no man.

How a Bicycle Works

A bicycle turns the pushing of your legs into forward motion. The pedals turn a crank, the crank
turns a chain ring, and a chain carries the motion back to a small sprocket on the rear wheel.
Because the chain ring is larger than the sprocket, each turn of the pedals turns the wheel more
than once. Gears let the rider change this ratio: a low gear makes climbing a hill easier but
slow, and a high gear lets you go fast on the flat but needs more force at each stroke.

The bicycle stays upright mostly because the rider steers it. When it begins to lean to one side,
the rider turns the front wheel slightly in that direction, which brings the wheels back under
the rider's weight. At speed this happens almost without thought, which is why it is easier to
balance a moving bicycle than a standing one. The shape of the front fork helps as well: it makes
the wheel turn into a lean on its own, even without a rider.

Looking after a bicycle is simple. Keep the tyres pumped to the pressure printed on their sides,
keep the chain clean and lightly oiled, and check the brakes before every long ride. A bicycle
that is cared for will last for decades and carry its owner many thousands of kilometres.

Stars and Planets

On a clear night far from city lights, you can see about two or three thousand stars with the
naked eye. They seem fixed in their patterns, which people have named after heroes, animals and
gods. The planets are different: they wander slowly against the background of stars from week to
week, which is where their name comes from, since the Greek word for planet means wanderer.

The nearest star after the Sun is more than four light years away. Light from it, travelling at
nearly three hundred thousand kilometres every second, takes over four years to reach us, so we
see it not as it is now but as it was when that light set out. When you look at the night sky you
are looking back in time, and the further you look, the older the light.

The Moon has no light of its own; it shines because it reflects the light of the Sun. As it
travels around the Earth once a month, we see different amounts of its sunlit half, and so it
seems to grow from a thin crescent to a full disc and then shrink again. The same side always
faces us, because the Moon turns exactly once on its axis for each trip around the Earth.
"""
