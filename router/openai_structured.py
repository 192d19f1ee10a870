"""Structured-output fields of OpenAI's API and vLLM's, read into one `StructuredOutput`.

Accepted, as `vllm serve` accepts them: `response_format` `{"type": "json_object"}` and
`{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` (`{"type": "text"}` asks
for nothing); `structured_outputs` with one of `json`, `regex`, `choice`, `grammar`; and the
older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`. At most one constraint
per request. The constraint's text is checked (a valid schema, regex or grammar) before any
worker is touched.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from cluster.engine.grammar import check
from cluster.errors import InvalidArgument
from cluster.structured_output import StructuredOutput

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class StructuredFields(BaseModel):
    """The body fields; `constraint()` reads them (None: unconstrained)."""

    model_config = ConfigDict(extra="ignore")

    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def constraint(self) -> StructuredOutput | None:
        found: list[tuple[str, StructuredOutput]] = []
        if self.response_format is not None:
            so = _response_format(self.response_format)
            if so is not None:
                found.append(("response_format", so))
        for name, value in (self.structured_outputs or {}).items():
            if value is not None:
                found.append(("structured_outputs", _vllm(name, value, "structured_outputs")))
        for field, name in _GUIDED.items():
            value = getattr(self, field)
            if value is not None:
                found.append((field, _vllm(name, value, field)))
        if len(found) > 1:
            names = sorted({f for f, _ in found})
            raise InvalidArgument(
                f"at most one output constraint per request, got {names}", param=names[0]
            )
        if not found:
            return None
        field, so = found[0]
        try:
            check(so)
        except InvalidArgument as e:
            raise InvalidArgument(e.message, param=field) from None
        return so


def _response_format(fmt: dict[str, Any]) -> StructuredOutput | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | bool):
            raise InvalidArgument(
                "response_format.json_schema must be an object with a `schema`",
                param="response_format",
            )
        return _built(lambda: StructuredOutput.schema(spec.get("schema", {})), "response_format")
    raise InvalidArgument(
        f"response_format.type must be text, json_object or json_schema, got {kind!r}",
        param="response_format",
    )


def _vllm(name: str, value: Any, field: str) -> StructuredOutput:
    if name == "json":
        return _built(
            lambda: StructuredOutput.schema(json.loads(value) if isinstance(value, str) else value),
            field,
        )
    if name == "json_object" and value is True:
        return StructuredOutput("json_object")
    if name == "choice":
        return _built(lambda: StructuredOutput.choice(value), field)
    if name in ("regex", "grammar") and isinstance(value, str):
        return _built(lambda: StructuredOutput(name, value), field)
    raise InvalidArgument(
        f"{field}: expected json, regex, choice or grammar, got {name!r}", param=field
    )


def _built(make, field: str) -> StructuredOutput:
    try:
        return make()
    except (InvalidArgument, TypeError, ValueError) as e:
        message = e.message if isinstance(e, InvalidArgument) else str(e)
        raise InvalidArgument(message, param=field) from None
