"""Tool-call formats that wrap each call in `<tool_call>` tags: Hermes (JSON inside, also what
Qwen2.5 and Qwen3 chat models write) and Qwen3-Coder (XML-like functions and parameters)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from router.chat.tool_call import ToolCall
from router.chat.tool_parser import ToolParser

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def tagged_blocks(region: str, final: bool) -> Iterator[str]:
    """The bodies of the `<tool_call>` blocks in `region`, in order; the last one unterminated
    only when the answer has ended. Stops at text between blocks that is not whitespace."""
    pos = 0
    while True:
        start = region.find(OPEN, pos)
        if start < 0 or region[pos:start].strip():
            return
        end = region.find(CLOSE, start)
        if end < 0:
            if final:
                yield region[start + len(OPEN) :]
            return
        yield region[start + len(OPEN) : end]
        pos = end + len(CLOSE)


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call."""

    name = "hermes"
    markers = (OPEN,)

    def calls(self, region: str, final: bool) -> list[ToolCall]:
        out = []
        for body in tagged_blocks(region, final):
            try:
                obj = json.loads(body)
            except ValueError:
                break
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                break
            out.append(ToolCall.of(obj["name"], obj.get("arguments", {})))
        return out


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*$", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


class Qwen3CoderParser(ToolParser):
    """`<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>`.
    Values are written untyped; the tool's JSON schema says how to read each one."""

    name = "qwen3_coder"
    markers = (OPEN,)

    def calls(self, region: str, final: bool) -> list[ToolCall]:
        out = []
        for body in tagged_blocks(region, final):
            match = _FUNCTION.match(body)
            if match is None:
                break
            name = match.group(1).strip()
            types = self._parameter_types(name)
            args = {
                key.strip(): _typed(_unwrap(value), types.get(key.strip()))
                for key, value in _PARAMETER.findall(match.group(2))
            }
            out.append(ToolCall.of(name, args))
        return out

    def _parameter_types(self, function: str) -> dict[str, Any]:
        for tool in self.tools:
            spec = tool.get("function", {})
            if spec.get("name") == function:
                props = (spec.get("parameters") or {}).get("properties") or {}
                return {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
        return {}


def _unwrap(value: str) -> str:
    """Values sit on their own lines: one newline after the open tag and before the close."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _typed(value: str, kind: Any) -> Any:
    """A parameter's text read as its schema type; text that does not parse stays text."""
    if kind == "string":
        return value
    if kind in ("integer", "number", "boolean", "object", "array", "null") or kind is None:
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value
