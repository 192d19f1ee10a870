"""The tool parser contract a format implements, and the stream that feeds it deltas.

A format says where the tool-call region of an answer begins (`region_start`) and which
complete calls that region holds so far (`calls`). Everything before the region is content;
everything from it on belongs to the calls. The same two methods serve a whole answer and a
stream, so a stream's calls are exactly the whole answer's: a call is sent once it is complete
(its id and name, then its arguments), never retracted. A region that yields no call by the end
of the answer was not a tool call: its text is content.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

from router.chat.tool_call import ParsedMessage, ToolCall, ToolCallDelta


class ToolParser(ABC):
    """One model family's tool-call format. `tools` is the request's `tools` list (OpenAI
    form); formats that write arguments untyped use it to type them."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]]

    def __init__(self, tools: Sequence[dict[str, Any]] | None = None) -> None:
        self.tools = list(tools or ())

    def region_start(self, text: str, since: int = 0) -> int | None:
        """Where the tool-call region begins (searching from `since`), or None."""
        found = [i for i in (text.find(m, since) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def held_from(self, text: str) -> int:
        """Text from this index may still turn into a region's start: a stream holds it back."""
        longest = 0
        for marker in self.markers:
            for k in range(min(len(marker) - 1, len(text)), longest, -1):
                if text.endswith(marker[:k]):
                    longest = k
                    break
        cut = len(text) - longest
        while cut > 0 and text[cut - 1].isspace():  # whitespace before a call is not content
            cut -= 1
        return cut

    @abstractmethod
    def calls(self, region: str, final: bool) -> list[ToolCall]:
        """The complete, valid calls in `region`, in order, stopping at the first that is not.
        `final`: the answer has ended, so an unterminated last call may be taken as written."""

    def parse(self, text: str) -> ParsedMessage:
        """A whole answer: content before the region and the region's calls."""
        start = self.region_start(text)
        calls = self.calls(text[start:], final=True) if start is not None else []
        if not calls:
            return ParsedMessage(text)
        content = text[:start]
        return ParsedMessage(content if content.strip() else None, tuple(calls))


class ToolCallStream:
    """Feeds an answer's text deltas through a parser: each step returns the content to send
    now and the call deltas that became complete. `finish` flushes what was held back."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # content sent up to this index
        self.region: int | None = None
        self.done = 0  # calls sent
        self.ended = False

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        self.text += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        out = self._advance(final=True)
        self.ended = True
        return out

    @property
    def called(self) -> bool:
        """Whether any call was sent (the finish reason is then `tool_calls`)."""
        return self.done > 0

    def _advance(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        if self.region is None:
            longest = max(len(m) for m in self.parser.markers)
            start = self.parser.region_start(self.text, max(0, self.sent - longest))
            if start is None:
                upto = len(self.text) if final else self.parser.held_from(self.text)
                upto = max(upto, self.sent)
                content, self.sent = self.text[self.sent : upto], upto
                return content, []
            self.region = start
        content = self.text[self.sent : self.region]
        if not self.text[: self.region].strip():
            content = ""  # as `parse`: only whitespace before the calls is no content
        self.sent = max(self.sent, self.region)
        calls = self.parser.calls(self.text[self.region :], final)
        deltas = []
        for index in range(self.done, len(calls)):
            call = calls[index]
            deltas.append(ToolCallDelta(index, id=call.id, name=call.name))
            deltas.append(ToolCallDelta(index, arguments=call.arguments))
        self.done = len(calls)
        if final and not self.done:
            content += self.text[self.sent :]  # not a tool call after all
            self.sent = len(self.text)
        return content, deltas
