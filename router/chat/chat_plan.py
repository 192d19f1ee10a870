"""What one chat request does with its model's text: `tools` and `tool_choice` checked, the
constraint `required` and a named tool need, and the split of the answer into reasoning,
content and tool calls, whole or streamed.

`tool_choice` as OpenAI and vLLM: `none` (tools are shown to the template, no call is read),
`auto` (the default with tools: calls are read by the server's `--tool-call-parser`, which
`--enable-auto-tool-choice` must allow), `required` (the answer is constrained to a JSON list
of calls, `[{"name": ..., "parameters": {...}}]`), or a named function (the answer is
constrained to that function's parameters, and is its one call).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from cluster.errors import InvalidArgument
from cluster.structured_output import StructuredOutput
from router.chat.reasoning_parser import REASONING_PARSERS, ReasoningStream
from router.chat.registry import tool_parser
from router.chat.tool_call import ToolCall, ToolCallDelta
from router.chat.tool_parser import ToolCallStream
from router.prompt_tokenizer import TemplateCall

MAX_TOOLS = 128


@dataclass(frozen=True)
class ChatOptions:
    """The server's chat settings (`pdserve serve` flags of vLLM's names)."""

    tool_call_parser: str = ""
    enable_auto_tool_choice: bool = False
    reasoning_parser: str = ""
    chat_template: str = ""  # the server's template text (`--chat-template`); "": the model's
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # defaults for every request

    def template_call(
        self, kwargs: dict[str, Any] | None, add_generation_prompt: bool, continue_final: bool
    ) -> TemplateCall:
        """How one request renders its chat: its template variables over the server's."""
        merged = {**self.template_kwargs, **(kwargs or {})}
        return TemplateCall(merged, add_generation_prompt, continue_final, self.chat_template)


def chat_options(config: Any) -> ChatOptions:
    """The app's chat settings (`AppConfig`), their parser names checked."""
    options = ChatOptions(
        config.tool_call_parser,
        config.enable_auto_tool_choice,
        config.reasoning_parser,
        config.chat_template,
        json.loads(config.default_chat_template_kwargs or "{}"),
    )
    if options.tool_call_parser:
        tool_parser(options.tool_call_parser)  # raises, listing the known names
    if options.reasoning_parser and options.reasoning_parser not in REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {options.reasoning_parser!r}; "
            f"known: {sorted(REASONING_PARSERS)}"
        )
    return options


@dataclass(frozen=True)
class ChatAnswer:
    reasoning: str | None
    content: str | None
    tool_calls: tuple[ToolCall, ...]


class ChatPlan:
    """One request's plan; `constraint` goes into its sampling parameters."""

    def __init__(self, options: ChatOptions, tools: list[dict] | None, choice: Any) -> None:
        self.tools = _checked_tools(tools or [])
        names = [t["function"]["name"] for t in self.tools]
        if choice is None:
            choice = "auto" if self.tools else "none"
        self.mode, self.named = _mode(choice, names)
        if self.mode == "auto" and not (
            options.enable_auto_tool_choice and options.tool_call_parser
        ):
            raise InvalidArgument(
                '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                "and --tool-call-parser",
                param="tool_choice",
            )
        self.parser = (
            tool_parser(options.tool_call_parser, self.tools) if self.mode == "auto" else None
        )
        self.reasoning = REASONING_PARSERS.get(options.reasoning_parser)
        self.constraint = self._constraint()

    def _constraint(self) -> StructuredOutput | None:
        if self.mode == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": t["function"]["name"]},
                        "parameters": t["function"].get("parameters") or {"type": "object"},
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for t in self.tools
            ]
            return StructuredOutput.schema(
                {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
            )
        if self.mode == "named":
            spec = next(t["function"] for t in self.tools if t["function"]["name"] == self.named)
            return StructuredOutput.schema(spec.get("parameters") or {"type": "object"})
        return None

    def answer(self, text: str) -> ChatAnswer:
        """A whole answer's parts."""
        stream = self.stream()
        r1, c1, _ = stream.feed(text)
        r2, c2, _ = stream.finish()
        reasoning, content, calls = r1 + r2, c1 + c2, tuple(stream.calls)
        if calls and not content.strip():
            content = ""
        return ChatAnswer(reasoning or None, content or None, calls)

    def stream(self) -> ChatStream:
        return ChatStream(self)


class ChatStream:
    """Feeds an answer's text deltas; each step returns (reasoning, content, call deltas)."""

    def __init__(self, plan: ChatPlan) -> None:
        self.plan = plan
        self.reasoning = ReasoningStream(plan.reasoning) if plan.reasoning else None
        self.tools = ToolCallStream(plan.parser) if plan.parser else None
        self.constrained = ""  # required / named: the whole answer is the calls' JSON
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> tuple[str, str, list[ToolCallDelta]]:
        reasoning, content = self.reasoning.feed(delta) if self.reasoning else ("", delta)
        return self._split(reasoning, content, final=False)

    def finish(self) -> tuple[str, str, list[ToolCallDelta]]:
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        return self._split(reasoning, content, final=True)

    def _split(self, reasoning: str, content: str, final: bool):
        if self.plan.mode in ("required", "named"):
            self.constrained += content
            if not final:
                return reasoning, "", []
            deltas = self._constrained_calls()
            return reasoning, "" if deltas else self.constrained, deltas
        if self.tools is None:
            return reasoning, content, []
        content, deltas = self.tools.feed(content)
        if final:
            rest, last = self.tools.finish()
            content, deltas = content + rest, deltas + last
        self.calls = self._from(deltas, self.calls)
        return reasoning, content, deltas

    def _constrained_calls(self) -> list[ToolCallDelta]:
        try:
            value = json.loads(self.constrained)
        except ValueError:  # cut short by max_tokens: no call, the text stays content
            return []
        if self.plan.mode == "named":
            self.calls = [ToolCall.of(self.plan.named, value)]
        else:
            self.calls = [ToolCall.of(c["name"], c.get("parameters", {})) for c in value]
        out = []
        for i, call in enumerate(self.calls):
            out += [
                ToolCallDelta(i, id=call.id, name=call.name),
                ToolCallDelta(i, arguments=call.arguments),
            ]
        return out

    @staticmethod
    def _from(deltas: list[ToolCallDelta], calls: list[ToolCall]) -> list[ToolCall]:
        calls = list(calls)
        for d in deltas:
            if d.name is not None:
                calls.append(ToolCall(d.name, "", d.id or ""))
            elif d.arguments:
                last = calls[d.index]
                calls[d.index] = ToolCall(last.name, last.arguments + d.arguments, last.id)
        return calls


def _checked_tools(tools: list[dict]) -> list[dict]:
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument(f"at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidArgument("each tool must be {type: function, function: {...}}", "tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidArgument("each tool's function needs a name", param="tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidArgument("a tool's parameters must be a JSON schema object", "tools")
    return tools


def _mode(choice: Any, names: list[str]) -> tuple[str, str]:
    if choice in ("none", "auto", "required"):
        if choice != "none" and not names:
            raise InvalidArgument(f"tool_choice {choice!r} needs tools", param="tool_choice")
        return choice, ""
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in names:
            raise InvalidArgument(f"tool_choice names {name!r}, not among the tools", "tool_choice")
        return "named", name
    raise InvalidArgument(
        "tool_choice must be none, auto, required or {type: function, function: {name}}",
        param="tool_choice",
    )
