"""A `GenerationService` double for the API tests (router/generation_service.py), with canned
tokens (" t0", " t1", ...), and helpers to read the OpenAI API's answers."""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from dataclasses import replace

from cluster.errors import InvalidArgument
from cluster.request import Request, TokenLogprobs, check_request_id
from cluster.sampling_params import SamplingParams
from router.chat.chat_plan import ChatOptions
from router.generation_chunk import GenerationChunk, Timing, Usage
from router.generation_service import ServedModel

MODEL = "tiny-llama"
MODEL_ID = "tiny-llama@0123abcd"
SERVER_MAX_TOKENS = 8
TIMING = Timing(0.001, 0.002, 0.003, 0.004, 0.005, 0.006, "prefill-0", "decode-0")
COMPLETION = {"prompt": "hi", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class FakeService:
    """A `GenerationService` that generates `max_tokens` tokens " t0", " t1", ...; a stop
    string ends it early with "stop".
    Knobs: `refuse` (raised on the first `anext`), `fail_at` (raised before token i),
    `hang_after_first`, `last_reason` (overrides the final finish reason), `close_s` (how long
    closing a generation takes, as the real one awaits its KV release)."""

    def __init__(self) -> None:
        self.model = ServedModel(MODEL, MODEL_ID, 128, 512, "float32", 16, "disaggregated")
        self.chat_options = ChatOptions()
        self.script: str | None = None  # set: the answer is this text, 3 characters a chunk
        self.refuse: BaseException | None = None
        self.fail_at: tuple[int, BaseException] | None = None
        self.hang_after_first = False
        self.last_reason: str | None = None
        self.close_s = 0.0
        self.requests: list[Request] = []
        self.messages: list[dict] | None = None
        self.opened = self.closed = 0

    async def tokenize(self, prompt: str) -> list[int]:
        return [ord(c) % 100 for c in prompt]

    def detokenize(self, token_ids: list[int]) -> str:
        return "".join(chr(t + 32) for t in token_ids)

    def token_text(self, token_id: int) -> str:
        return f" t{token_id}"

    def sampling_params(self, max_tokens: int | None = None, **fields) -> SamplingParams:
        fields = {k: v for k, v in fields.items() if v is not None}
        params = SamplingParams(
            max_tokens=SERVER_MAX_TOKENS if max_tokens is None else max_tokens, **fields
        )
        if params.seed is None and not params.greedy:
            params = replace(params, seed=random.getrandbits(63))
        return params

    async def build_request(
        self, prompt, prompt_token_ids, params, request_id=None, stream_interval=None
    ) -> Request:
        if prompt and prompt_token_ids:
            raise InvalidArgument("give either prompt or prompt_token_ids, not both", "prompt")
        ids = prompt_token_ids or [ord(c) % 100 for c in prompt or ""]
        if not ids:
            raise InvalidArgument("prompt is empty", param="prompt")
        if request_id:
            check_request_id(request_id)
        request = Request(
            uuid.uuid4().hex,  # as the orchestrator: an id of the server's, the client's a label
            tuple(ids),
            params,
            stream_interval=stream_interval or 1,
            label=request_id or "",
        )
        self.requests.append(request)
        return request

    async def chat_prompt(self, messages: list[dict], tools=None, template=None) -> list[int]:
        self.messages, self.tools, self.template = messages, tools, template
        if any(m["role"] not in ("system", "user", "assistant", "tool") for m in messages):
            raise InvalidArgument("cannot render messages: unknown role", param="messages")
        return [ord(c) % 100 for m in messages for c in f"{m['role']}: {m['content']}\n"]

    async def generate(self, request: Request):
        self.opened += 1
        try:
            if self.refuse is not None:
                raise self.refuse
            params = request.params
            if self.script is not None:
                pieces = [self.script[i : i + 3] for i in range(0, len(self.script), 3)]
                for i, piece in enumerate(pieces[:-1]):
                    yield GenerationChunk(request.name, (i,), piece)
                yield self._last(request, len(pieces), pieces[-1], "stop")
                return
            for i in range(params.max_tokens):
                if self.fail_at is not None and self.fail_at[0] == i:
                    raise self.fail_at[1]
                if i == 1 and self.hang_after_first:
                    await asyncio.Event().wait()
                text = f" t{i}"
                if text.strip() in params.stop:
                    yield self._last(request, i, "", "stop")
                    return
                if i == params.max_tokens - 1:
                    last = self._last(request, i + 1, text, self.last_reason or "length")
                    yield replace(last, logprobs=fake_logprobs(params, i + 1))
                    return
                yield GenerationChunk(request.name, (i,), text, logprobs=fake_logprobs(params, i))
        finally:
            # as the real one awaits its KV release: must not be cancelled
            await asyncio.sleep(self.close_s)
            self.closed += 1

    def _last(self, request: Request, n: int, text: str, reason: str) -> GenerationChunk:
        usage = Usage(len(request.prompt_token_ids), n, cached_prompt_tokens=1)
        return GenerationChunk(request.name, (n,), text, reason, usage, TIMING)


def fake_logprobs(params: SamplingParams, token: int) -> tuple[TokenLogprobs, ...]:
    """Token i: logprob -i/10, alternatives i+j at -(1+j) for j < params.logprobs."""
    if params.logprobs is None:
        return ()
    top = tuple((token + j, -1.0 - j) for j in range(params.logprobs))
    return (TokenLogprobs(-token / 10, top),)


def sse_payloads(body: str) -> list[dict | str]:
    """The `data:` payloads of an SSE body, checking the framing; "[DONE]" stays a string."""
    assert body.endswith("data: [DONE]\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), events
    return [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in events]


def assert_error(r, status: int, type_: str, param: str | None = None, code=None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type_ and error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error
