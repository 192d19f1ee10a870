"""The payloads a tool parser hands to the OpenAI layer: whole calls and streamed deltas."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    """An id for one tool call, unique within a response (OpenAI: `call_...`)."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    """One function call the model asked for; `arguments` is a JSON object, as text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    @classmethod
    def of(cls, name: str, arguments: Any) -> ToolCall:
        """A call from parsed arguments (a dict) or from arguments already written as JSON."""
        if isinstance(arguments, str):
            return cls(name, arguments)
        return cls(name, json.dumps(arguments if arguments is not None else {}, ensure_ascii=False))


@dataclass(frozen=True)
class ParsedMessage:
    """A whole answer split into its parts; `content` is None when only calls were written."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of the `index`-th call, as OpenAI sends them: the first piece carries
    the id and the name (and empty arguments), the later ones fragments of the arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""
