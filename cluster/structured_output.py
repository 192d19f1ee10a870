"""What a constrained request's output must match: a JSON schema, any JSON object, a regular
expression, one of a list of strings, or a grammar (EBNF, as xgrammar reads it).

Checked for shape and size when the request is admitted; whether the text is a valid schema,
regex or grammar is checked when it is compiled, which the router does before any worker is
touched (`cluster.engine.grammar.check`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from cluster.errors import InvalidArgument

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")
# Compiling is paid on the router's and the engine's threads: the text is bounded.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 256


@dataclass(frozen=True)
class StructuredOutput:
    """`spec`: the schema as JSON text, the regex, the EBNF grammar, or for `choice` a JSON
    list of the allowed strings; empty for `json_object`."""

    kind: Kind
    spec: str = ""

    def __post_init__(self) -> None:
        param = "structured_outputs"
        if self.kind not in KINDS:
            raise InvalidArgument(f"unknown structured output kind {self.kind!r}", param=param)
        if len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidArgument(
                f"a {self.kind} constraint is at most {MAX_SPEC_CHARS} characters", param=param
            )
        if self.kind == "json_object" or self.kind == "regex" or self.kind == "grammar":
            if self.kind != "json_object" and not self.spec:
                raise InvalidArgument(f"a {self.kind} constraint must not be empty", param=param)
            return
        try:
            value = json.loads(self.spec)
        except ValueError as e:
            raise InvalidArgument(f"{self.kind} is not valid JSON: {e}", param=param) from None
        if self.kind == "json_schema" and not isinstance(value, dict | bool):
            raise InvalidArgument("json_schema must be a JSON object", param=param)
        if self.kind == "choice" and not (
            isinstance(value, list)
            and 0 < len(value) <= MAX_CHOICES
            and all(isinstance(c, str) and c for c in value)
        ):
            raise InvalidArgument(
                f"choice must be 1 to {MAX_CHOICES} non-empty strings", param=param
            )

    @classmethod
    def schema(cls, schema: dict | bool) -> StructuredOutput:
        return cls("json_schema", json.dumps(schema))

    @classmethod
    def choice(cls, options: list[str]) -> StructuredOutput:
        return cls("choice", json.dumps(options))
