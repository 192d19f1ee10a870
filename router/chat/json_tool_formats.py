"""Tool-call formats written as bare JSON: Llama 3's (the answer is the call) and Mistral's
(after `[TOOL_CALLS]`, a JSON list of calls or, in newer tokenizers, `name[ARGS]{...}`)."""

from __future__ import annotations

import json
import secrets
import string
from typing import Any

from router.chat.tool_call import ToolCall
from router.chat.tool_parser import ToolParser

_DECODER = json.JSONDecoder()


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _object_at(text: str, pos: int) -> tuple[dict[str, Any], int] | None:
    """The JSON object starting at `pos` and the index after it, or None (not one, or not
    complete yet)."""
    try:
        obj, end = _DECODER.raw_decode(text, pos)
    except ValueError:
        return None
    return (obj, end) if isinstance(obj, dict) else None


def _listed_calls(region: str, pos: int, separator: str) -> list[ToolCall]:
    """The calls written as JSON objects from `pos` on, `separator` between them."""
    out = []
    while True:
        found = _object_at(region, _skip_space(region, pos))
        call = _call(found[0]) if found else None
        if call is None:
            return out
        out.append(call)
        pos = _skip_space(region, found[1])
        if not region.startswith(separator, pos):
            return out
        pos += 1


def _call(obj: dict[str, Any]) -> ToolCall | None:
    name = obj.get("name")
    if not isinstance(name, str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall.of(name, args)


class Llama3JsonParser(ToolParser):
    """The whole answer is `{"name": ..., "parameters": {...}}` (several joined by `;`),
    optionally after `<|python_tag|>`; an answer that starts otherwise is content."""

    name = "llama3_json"
    markers = ("<|python_tag|>", "{")

    def region_start(self, text: str, since: int = 0) -> int | None:
        start = _skip_space(text, 0)
        return start if text.startswith(self.markers, start) else None

    def held_from(self, text: str) -> int:
        return 0 if self.markers[0].startswith(text.lstrip()) else len(text)

    def calls(self, region: str, final: bool) -> list[ToolCall]:
        pos = len(self.markers[0]) if region.startswith(self.markers[0]) else 0
        return _listed_calls(region, pos, ";")


def _mistral_id() -> str:
    """Mistral's chat templates accept only 9-character alphanumeric call ids."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class MistralParser(ToolParser):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or `[TOOL_CALLS]name[ARGS]{...}`
    repeated (tokenizer v11 and later)."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def calls(self, region: str, final: bool) -> list[ToolCall]:
        pos = _skip_space(region, len(self.markers[0]))
        if region.startswith("[", pos):
            found = _listed_calls(region, pos + 1, ",")
        else:
            found = self._named(region, pos)
        return [ToolCall(c.name, c.arguments, _mistral_id()) for c in found]

    def _named(self, region: str, pos: int) -> list[ToolCall]:
        out = []
        while True:
            args_at = region.find("[ARGS]", pos)
            if args_at < 0:
                return out
            name = region[pos:args_at].strip()
            found = _object_at(region, _skip_space(region, args_at + len("[ARGS]")))
            if not name or found is None:
                return out
            out.append(ToolCall.of(name, found[0]))
            pos = _skip_space(region, found[1])
            if region.startswith(self.markers[0], pos):
                pos += len(self.markers[0])
