"""The interface the API layers call: `GenerationService`, and the `ServedModel` it describes.

router/grpc_api.py and router/openai_api.py turn their messages into calls of it; `Orchestrator`
(router/orchestrator.py) implements it, and API tests use doubles. The dependency runs one
way: the API modules know this interface, never the orchestrator, and the orchestrator imports
no API module.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from cluster.model.info import generation_defaults
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from router.chat.chat_plan import ChatOptions
from router.generation_chunk import GenerationChunk
from router.prompt_tokenizer import TemplateCall

if TYPE_CHECKING:
    from router.pool_status import ClusterStats


@dataclass(frozen=True)
class ServedModel:
    """The model this app serves, as `GetModelInfo` and `GET /v1/models` describe it."""

    name: str  # the served name: `served_name`, else the hub id or the directory's name
    model_id: str
    max_context_length: int
    vocab_size: int
    dtype: str
    block_size: int
    mode: str  # "disaggregated" or "colocated"
    # what a request that leaves a sampling setting unset gets (`--generation-config`)
    sampling_defaults: tuple[tuple[str, float], ...] = ()

    @property
    def names(self) -> tuple[str, str]:
        """What a request may call the model: its name or its id."""
        return (self.name, self.model_id)


def served_model(config: Any, info: Any) -> ServedModel:
    """The `ServedModel` of an app (`AppConfig`) serving `info`'s checkpoint."""
    return ServedModel(
        name=config.model.served_name,
        model_id=info.model_id,
        max_context_length=info.max_model_len,
        vocab_size=info.spec.vocab_size,
        dtype=config.model.dtype,
        block_size=config.prefill.cache.block_size,
        mode=config.mode,
        sampling_defaults=sampling_defaults(config.generation_config, info),
    )


def sampling_defaults(source: str, info: Any) -> tuple[tuple[str, float], ...]:
    """`--generation-config`: "auto" the checkpoint's (`ModelInfo.sampling_defaults`), "vllm"
    none, else the generation_config.json of that directory."""
    if source == "auto":
        return info.sampling_defaults
    if source == "vllm":
        return ()
    return generation_defaults(Path(source))


class GenerationService(Protocol):
    model: ServedModel
    chat_options: ChatOptions  # tool-call and reasoning parsers (router/chat)

    def sampling_params(self, max_tokens: int | None = None, **fields: Any) -> SamplingParams:
        """The request's sampling parameters, server defaults filled in for fields left None."""
        ...

    async def build_request(
        self,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        params: SamplingParams,
        request_id: str | None = None,
        stream_interval: int | None = None,
    ) -> Request:
        """Hop 1: tokenize and validate. Raises InvalidArgument (naming the field): a
        `request_id` that is not a label (`cluster.request.check_request_id`),
        text too large for the context (checked before it is tokenized), bad values. A long
        prompt is tokenized off the event loop. `stream_interval` None: the server's."""
        ...

    async def chat_prompt(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        template: TemplateCall | None = None,
    ) -> list[int]:
        """Chat messages rendered with the model's chat template, tokenized; bounded in count
        and size before they are rendered (router/prompt_tokenizer.py)."""
        ...

    async def tokenize(self, prompt: str) -> list[int]:
        """A prompt's token ids, under the same bounds as a generation's."""
        ...

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of `token_ids` (ids in the vocabulary)."""
        ...

    def token_text(self, token_id: int) -> str:
        """A token's own text (for logprobs)."""
        ...

    def generate(self, request: Request) -> AsyncIterator[GenerationChunk]:
        """Hops 2-5: the request's chunks, the last one with its finish reason. A refused
        request raises a PdServeError before the first chunk. Whoever opens the iterator closes
        it (`aclose`) on every exit: closing it early aborts the request and frees its KV."""
        ...

    async def stats(self) -> ClusterStats:
        """Every pool's size and load and every engine replica's stats (`GetStats`)."""
        ...
