"""Reasoning kept apart from the answer: a reasoning model (Qwen3, DeepSeek-R1) writes `<think>...</think>`
before its answer; that text goes to `reasoning_content` (vLLM's --reasoning-parser, SGLang's
separate_reasoning), not to `content`, and tool calls are looked for only in what follows it.

Two ways a block starts: the model opens it itself (Qwen3), or the chat template already opened it at the
end of the prompt (DeepSeek-R1, Qwen3 thinking templates that write `<think>\n`), so the output starts
inside it. With enable_thinking false a Qwen3 template writes an empty block into the prompt and the
output is all answer.
"""
from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")  # vLLM's names; both read <think> blocks


@dataclass(frozen=True)
class ReasoningPlan:
    starts_inside: bool  # the prompt ends inside an open block
    closed_in_prompt: bool = False  # the prompt ends after a closed block (enable_thinking false): no reasoning

    @property
    def may_reason(self) -> bool:
        """Whether the output may hold reasoning: structured outputs then wait for its end (prepare.py)."""
        return not self.closed_in_prompt

    def split(self, text: str) -> tuple[str | None, str]:
        """The whole output -> (reasoning, content); the same cut a stream makes."""
        s = ReasoningStream(self)
        reasoning, content = s.feed(text, final=True)
        return (reasoning if s.reasoned else None), content


def plan_reasoning(template: str | None, prompt_tail: str, name: str | None) -> ReasoningPlan | None:
    """The plan for a chat request: from --reasoning-parser (`name`) or, by default, from a chat template that
    knows <think>; `prompt_tail` is the end of the rendered prompt (where a template may have opened a block)."""
    if name is None and (not template or START not in template):
        return None
    tail = prompt_tail.rstrip()
    return ReasoningPlan(starts_inside=tail.endswith(START), closed_in_prompt=tail.endswith(END))


def _held(text: str, marker: str) -> int:
    """How many trailing characters of `text` could still be the start of `marker`."""
    return next((k for k in range(min(len(text), len(marker) - 1), 0, -1) if marker.startswith(text[-k:])), 0)


class ReasoningStream:
    """One choice's text split as it streams: (reasoning, content) deltas, holding back only the characters
    that may still turn into a marker."""

    def __init__(self, plan: ReasoningPlan) -> None:
        self.state = "reasoning" if plan.starts_inside else "opening"  # opening: the block may still begin
        self.reasoned = plan.starts_inside
        self.pending = ""  # text not yet given out
        self.after_end = False  # the newlines a model writes after </think> are neither reasoning nor answer

    @property
    def in_reasoning(self) -> bool:
        return self.state == "reasoning"

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.pending += delta
        reasoning = ""
        if self.state == "opening":
            head = self.pending.lstrip()
            if head.startswith(START):
                self.state, self.reasoned, self.pending = "reasoning", True, head[len(START):]
            elif final or (head and not START.startswith(head)):
                self.state = "answer"
            else:
                return "", ""
        if self.state == "reasoning":
            at = self.pending.find(END)
            if at < 0:
                keep = 0 if final else _held(self.pending, END)
                cut = len(self.pending) - keep
                reasoning, self.pending = self.pending[:cut], self.pending[cut:]
                return reasoning, ""
            reasoning, self.pending = self.pending[:at], self.pending[at + len(END):]
            self.state, self.after_end = "answer", True
        if self.after_end:
            self.pending = self.pending.lstrip("\n")
            self.after_end = not self.pending
        content, self.pending = self.pending, ""
        return reasoning, content
