"""Request fields of OpenAI's API (and vLLM's extensions) that pdserve does not implement.

Each is declared, so that a request using one is refused with a 400 naming the field rather
than silently served as if the field were absent. Absent, `null`, and the values that ask for
nothing (`functions: []`, `best_of: 1`, ...) are accepted.
Fields that cannot change the generated tokens (`user`, `metadata`, `store`, `service_tier`,
...) are not listed here: like any unknown field, they are ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationInfo

# field -> the values, besides null, that ask for nothing and are accepted.
OFF_VALUES: dict[str, tuple[Any, ...]] = {
    # OpenAI
    "best_of": (1,),
    "suffix": ("",),
    "functions": ([],),
    "function_call": ("none",),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    # vLLM extensions
    "min_tokens": (0,),
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "bad_words": ([],),
    "allowed_token_ids": (),
    "prompt_logprobs": (),
    "include_stop_str_in_output": (False,),
    "truncate_prompt_tokens": (),
    "logits_processors": (),
    "echo": (False,),
    "chat_template": (),
}


def _refuse_unless_off(value: Any, info: ValidationInfo) -> Any:
    name = info.field_name or "field"
    off = OFF_VALUES[name]
    if value is None or any(_same(value, v) for v in off):
        return value
    accepted = " or ".join(json.dumps(v) for v in (None, *off))
    raise ValueError(f"{name} is not supported by this server; leave it out or send {accepted}")


def _same(value: Any, off: Any) -> bool:
    """Equal, and not a bool standing for a number (`true == 1` in Python, not in JSON)."""
    return value == off and isinstance(value, bool) == isinstance(off, bool)


# A field pdserve does not implement (its accepted values are listed in OFF_VALUES).
Unsupported = Annotated[Any, AfterValidator(_refuse_unless_off)]


class _Refusing(BaseModel):
    model_config = ConfigDict(extra="ignore")


class UnsupportedSamplingFields(_Refusing):
    """What neither endpoint implements."""

    min_tokens: Unsupported = None
    use_beam_search: Unsupported = None
    length_penalty: Unsupported = None
    bad_words: Unsupported = None
    allowed_token_ids: Unsupported = None
    prompt_logprobs: Unsupported = None
    include_stop_str_in_output: Unsupported = None
    truncate_prompt_tokens: Unsupported = None
    logits_processors: Unsupported = None


class UnsupportedCompletionFields(UnsupportedSamplingFields):
    best_of: Unsupported = None
    suffix: Unsupported = None


class UnsupportedChatFields(UnsupportedSamplingFields):
    functions: Unsupported = None
    function_call: Unsupported = None
    audio: Unsupported = None
    modalities: Unsupported = None
    prediction: Unsupported = None
    web_search_options: Unsupported = None
    echo: Unsupported = None
    chat_template: Unsupported = None
