"""Fixed prompts the SmolLM2 benchmarks and quality checks share: chat questions (topics x kinds) and a
public-domain text for perplexity (loadtest/data/alice_ch1.txt, Carroll, 1865)."""
from __future__ import annotations

from pathlib import Path

TOPICS = ["the moon", "photosynthesis", "the French revolution", "Python lists", "volcanoes", "the heart",
          "rainbows", "bees", "gravity", "the internet", "chess", "coffee", "glaciers", "the Roman empire",
          "electricity", "sleep"]
KINDS = ["Explain {} in one paragraph.", "What is {}?", "Give three facts about {}.", "Write a haiku about {}."]
PERPLEXITY_TEXT = Path(__file__).parent / "data" / "alice_ch1.txt"


def questions(n: int) -> list[str]:
    """The first n chat questions, every kind of each topic in turn."""
    return [k.format(t) for t in TOPICS for k in KINDS][:n]
