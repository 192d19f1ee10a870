"""The tool-call formats by the names `--tool-call-parser` takes (vLLM's)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from router.chat.json_tool_formats import Llama3JsonParser, MistralParser
from router.chat.tag_tool_formats import HermesParser, Qwen3CoderParser
from router.chat.tool_parser import ToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Qwen3CoderParser, Llama3JsonParser, MistralParser)
}


def tool_parser(name: str, tools: Sequence[dict[str, Any]] | None = None) -> ToolParser:
    """The parser registered as `name`, for one request's `tools`."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name](tools)
