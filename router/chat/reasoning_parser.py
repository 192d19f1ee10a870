"""Reasoning written between `<think>` and `</think>`, split from the answer's content.

Two conventions, by vLLM's names:
- `deepseek_r1`: the chat template opens `<think>` in the prompt, so the answer starts in
  reasoning (a leading `<think>` is skipped) and is reasoning up to `</think>`, all of it if the
  tag never comes;
- `qwen3`: the model opens `<think>` itself; an answer that does not start with it (thinking
  switched off by `enable_thinking: false`) is all content.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_in_reasoning: bool

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole answer; None where a part is empty."""
        stream = ReasoningStream(self)
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning or None, content or None


def _held(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningStream:
    """Feeds an answer's deltas; each step returns (reasoning delta, content delta)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.pending = ""
        # "start": not yet known whether a `<think>` opens the answer
        self.mode = "start"
        self.starts_in_reasoning = parser.starts_in_reasoning

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.pending += delta
        reasoning = content = ""
        if self.mode == "start":
            if START.startswith(self.pending) and not final:
                return "", ""
            opened = self.pending.startswith(START)
            if opened:
                self.pending = self.pending[len(START) :]
            self.mode = "reasoning" if opened or self.starts_in_reasoning else "content"
        if self.mode == "reasoning":
            end = self.pending.find(END)
            if end < 0:
                keep = 0 if final else _held(self.pending, END)
                cut = len(self.pending) - keep
                reasoning, self.pending = self.pending[:cut], self.pending[cut:]
                return reasoning, ""
            reasoning = self.pending[:end]
            self.pending = self.pending[end + len(END) :]
            self.mode = "content"
        content, self.pending = self.pending, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        return self.feed("", final=True)


REASONING_PARSERS: dict[str, ReasoningParser] = {
    p.name: p
    for p in (
        ReasoningParser("deepseek_r1", starts_in_reasoning=True),
        ReasoningParser("qwen3", starts_in_reasoning=False),
    )
}
