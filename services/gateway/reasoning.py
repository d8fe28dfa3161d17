"""Reasoning kept apart from the answer: the `<think>...</think>` block a reasoning model (Qwen3, DeepSeek-R1)
writes before its answer becomes `reasoning_content` (vLLM's --reasoning-parser, SGLang's separate_reasoning),
streamed as its own deltas, counted in usage as reasoning_tokens, and kept out of tool-call parsing.

The parser is chosen from the chat template (a template that mentions `<think>` teaches the block) unless the
gateway's --reasoning-parser says otherwise. A template may open the block itself (DeepSeek-R1's ends the
generation prompt with `<think>\\n`): then the output starts inside the reasoning, which the prompt's own tail
tells; with Qwen3's `enable_thinking: false` the prompt already holds an empty block and the output is all answer.
"""
from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
PARSERS = ("auto", "none", "qwen3", "deepseek_r1")


def parser_for(setting: str, chat_template: str | None) -> str | None:
    """The reasoning parser in force: None (no reasoning), "qwen3" or "deepseek_r1"."""
    if setting == "none":
        return None
    if setting == "auto":
        return "qwen3" if chat_template and START in chat_template else None
    return setting


@dataclass
class ReasoningSplit:
    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """One choice's text split as it streams: reasoning until END, content after it. Text that may be the start
    of a tag is held back until the next piece says what it is."""

    def __init__(self, starts_inside: bool) -> None:
        # Outside a block, the output may still open one with its very first characters (Qwen3 writes <think>).
        self.state = "reasoning" if starts_inside else "maybe_start"
        self.buffer = ""
        self.reasoning = ""
        self.content = ""
        self._content_started = False

    def feed(self, text: str) -> ReasoningSplit:
        self.buffer += text
        out = ReasoningSplit()
        while True:
            if self.state == "maybe_start":
                stripped = self.buffer.lstrip()
                if stripped.startswith(START):
                    self.buffer, self.state = stripped[len(START):], "reasoning"
                    continue
                if START.startswith(stripped):  # could still become the tag (or is only whitespace)
                    return out
                self.state = "content"
                continue
            if self.state == "reasoning":
                i = self.buffer.find(END)
                if i >= 0:
                    out.reasoning += self.buffer[:i]
                    self.buffer, self.state = self.buffer[i + len(END):], "content"
                    continue
                keep = _partial_suffix(self.buffer, END)
                out.reasoning += self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            # content: the newlines that separate the block from the answer are not part of the answer
            if not self._content_started:
                self.buffer = self.buffer.lstrip("\n")
                if not self.buffer:
                    break
                self._content_started = True
            out.content += self.buffer
            self.buffer = ""
            break
        self.reasoning += out.reasoning
        self.content += out.content
        return out

    def finish(self) -> ReasoningSplit:
        """What is still held once the choice is over (a cut-off tag is text after all)."""
        rest, self.buffer = self.buffer, ""
        if self.state == "reasoning":
            self.reasoning += rest
            return ReasoningSplit(reasoning=rest)
        self.content += rest
        return ReasoningSplit(content=rest)

    @property
    def in_reasoning(self) -> bool:
        return self.state != "content"


def split_reasoning(text: str, starts_inside: bool) -> ReasoningSplit:
    s = ReasoningStream(starts_inside)
    s.feed(text)
    s.finish()
    return ReasoningSplit(s.reasoning, s.content)


def starts_inside(prompt_tail: str) -> bool:
    """The prompt opened a block it did not close: the output begins inside the reasoning."""
    tail = prompt_tail.rstrip()
    return tail.endswith(START)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    return next((k for k in range(min(len(text), len(tag) - 1), 0, -1) if tag.startswith(text[-k:])), 0)
