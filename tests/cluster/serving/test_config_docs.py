"""Every field of the config's dict form is described in its JSON schema (`pdserve
config-schema`, cluster/serving/config_docs.py), closed sets of values are enums there, and the
enums of the chat parsers are exactly the names router/chat registers."""

from __future__ import annotations

import typing
from dataclasses import fields, is_dataclass

import pytest

from cluster.config import parse_config
from cluster.errors import InvalidArgument
from cluster.serving.app_config import (
    AppConfig,
    ReasoningParserName,
    ToolCallParserName,
    app_config_schema,
)
from cluster.serving.config_docs import FIELD_DOCS, field_doc
from router.chat.reasoning_parser import REASONING_PARSERS
from router.chat.registry import TOOL_PARSERS


def _objects(schema: dict) -> list[tuple[str, dict]]:
    return [("AppConfig", schema), *schema["$defs"].items()]


def test_every_field_in_the_schema_has_a_description() -> None:
    schema = app_config_schema()
    undescribed = [
        f"{name}.{field}"
        for name, node in _objects(schema)
        for field, prop in node.get("properties", {}).items()
        if not prop.get("description", "").strip()
    ]
    assert not undescribed, f"fields without a description: {undescribed}"
    # every nested config is in $defs, so the walk above saw each of them
    assert set(schema["$defs"]) == set(_config_classes()) - {"AppConfig"}


def _config_classes() -> dict[str, type]:
    found: dict[str, type] = {}

    def walk(cls: type) -> None:
        found[cls.__name__] = cls
        hints = typing.get_type_hints(cls, include_extras=True)
        for f in fields(cls):
            for t in (hints[f.name], *typing.get_args(hints[f.name])):
                if isinstance(t, type) and is_dataclass(t) and t.__name__ not in found:
                    walk(t)

    walk(AppConfig)
    return found


def test_every_description_names_a_field_and_every_field_has_one() -> None:
    classes = _config_classes()
    for cls_name, docs in FIELD_DOCS.items():
        if cls_name == "DeploymentConfig":
            continue  # described through PoolConfig and RouterConfig, which inherit them
        own = {f.name for f in fields(classes[cls_name])}
        assert set(docs) <= own, (cls_name, set(docs) - own)
    for cls_name, cls in classes.items():
        assert all(field_doc(cls_name, f.name) for f in fields(cls)), cls_name


def test_closed_sets_are_enums() -> None:
    schema = app_config_schema()
    props = schema["properties"]
    assert props["mode"]["enum"] == ["disaggregated", "colocated"]
    model = schema["$defs"]["ModelConfig"]["properties"]
    assert model["dtype"]["enum"] == ["auto", "bfloat16", "float16", "float32"]
    assert "enum" in schema["$defs"]["TransferConfig"]["properties"]["transport"]
    assert set(typing.get_args(ToolCallParserName)) == {"", *TOOL_PARSERS}
    assert set(typing.get_args(ReasoningParserName)) == {"", *REASONING_PARSERS}


@pytest.mark.parametrize(
    ("args", "param"),
    [
        ({"tool_call_parser": "json"}, "tool_call_parser"),
        ({"reasoning_parser": "r1"}, "reasoning_parser"),
        ({"model": {"path": "x", "dtype": "fp8"}}, "model.dtype"),
    ],
)
def test_a_value_outside_an_enum_is_refused_by_name(args, param) -> None:
    with pytest.raises(InvalidArgument) as e:
        parse_config(AppConfig, {"model": {"path": "x"}, **args})
    assert e.value.param == param and "expected" in e.value.message
