"""What chat applications read out of a model's text: tool calls and reasoning.

A model writes tool calls and its reasoning as plain text in a format of its family
(`<tool_call>{...}</tool_call>` for Hermes and Qwen, `[TOOL_CALLS]` for Mistral, a bare JSON
object for Llama 3, `<think>...</think>` for reasoning models). The parsers here turn that text
into OpenAI's message fields (`tool_calls`, `reasoning_content`, `content`), for a whole answer
and, fed delta by delta, for a stream. They see text only: no tokenizer, no engine, no Serve.
Parsers are chosen by name (`--tool-call-parser`, `--reasoning-parser`, vLLM's names) from
`TOOL_PARSERS` and `REASONING_PARSERS`.
"""

from __future__ import annotations

from router.chat.reasoning_parser import REASONING_PARSERS, ReasoningParser, ReasoningStream
from router.chat.registry import TOOL_PARSERS, tool_parser
from router.chat.tool_call import ParsedMessage, ToolCall, ToolCallDelta
from router.chat.tool_parser import ToolCallStream, ToolParser

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ParsedMessage",
    "ReasoningParser",
    "ReasoningStream",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "tool_parser",
]
