"""`n > 1` and batched prompts: one OpenAI request, n choices of each of its prompts, one
prefill of each prompt. Prompt i's choice j is the request's choice `i * n + j` (vLLM's index).

Each choice is a generation of its own (`GenerationService.generate`), so retries, migration,
cancellation and KV release stay those of one request. What they share is the prompt's KV:
choice 0 runs first, and its first chunk arrives only once its prompt is prefilled and the
prompt's full KV blocks are registered in that replica's prefix cache; only then do choices
1..n-1 start, and prefix affinity sends their identical prompts to that replica, whose cache
supplies every full block (`usage.cached_prompt_tokens`): the prompt is computed once, each
further choice recomputes only the tail of its last, partial block (whose logits it samples its
first token from). In colocated mode the one engine's cache does the same.

Seeds follow vLLM: a prompt's choice j samples with `seed + j` (mod 2**63), so a seeded request is
reproducible and its choices differ; an unseeded random request was given a random seed when its
sampling parameters were made (`GenerationService.sampling_params`), so the same holds. Greedy
choices are identical.

Usage counts as OpenAI does: each prompt once, the completions summed over the choices.

Each choice runs in a context of its own (`contextvars`), in which Serve's request context has
an internal request id of the choice's own (`_own_serve_request`): Serve's request router keeps
one pending call per internal id, and the calls a Serve replica makes inherit its request's, so
two choices waiting for a replica of one pool at once (their prefills) would otherwise leave
one of them waiting forever.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace

import anyio

from cluster.errors import PdServeError
from cluster.request import Request
from router.attempt import new_request_id
from router.generation_chunk import GenerationChunk, Usage

MAX_CHOICES = 16  # `n` above this is refused (400): each choice holds a sequence in decode
MAX_PROMPTS = 16  # prompts in one completions request; more is refused (400)
_SEEDS = 2**63  # SamplingParams' seed range

Generate = Callable[[Request], AsyncIterator[GenerationChunk]]


def choice_requests(request: Request, n: int) -> list[Request]:
    """`request` as its n choices: choice 0 is `request` itself, choice i a copy under a fresh
    id (engine, lease and stream state are per choice) sampling with seed + i."""
    choices = [request]
    for i in range(1, n):
        params = request.params
        if params.seed is not None:
            params = replace(params, seed=(params.seed + i) % _SEEDS)
        choices.append(replace(request, request_id=new_request_id(), params=params))
    return choices


def total_usage(usages: Sequence[Usage], n: int | None = None) -> Usage:
    """The request's usage from its choices' (`n` a prompt, in index order; None: one prompt):
    each prompt counted once, completions summed; a prompt's cached tokens are the most any of
    its choices took from the prefix cache (with the prompt shared, the tokens of it that were
    not computed again)."""
    n = n or len(usages)
    prompts = [usages[i : i + n] for i in range(0, len(usages), n)]
    return Usage(
        prompt_tokens=sum(p[0].prompt_tokens for p in prompts),
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_prompt_tokens=sum(max(u.cached_prompt_tokens for u in p) for p in prompts),
    )


async def fan_out(
    generate: Generate, requests: Sequence[Request], n: int | None = None
) -> AsyncIterator[tuple[int, GenerationChunk]]:
    """The chunks of the choices `requests` (`n` a prompt, prompt by prompt; None: all of one
    prompt), as (choice index, chunk), each choice's in order, up to each one's chunk with a
    finish reason; then the iteration ends.

    Each prompt's choice 0 starts at once; the others start after every prompt's choice 0 has
    its first chunk (its prompt is prefilled and cached by then). Nothing is yielded before
    every choice has its first chunk, so a refused choice (429, 503, ...) fails the whole
    request before it is answered, with its own status. A choice that fails later fails the
    iteration. However the iteration ends (finished, failed, closed, cancelled), every choice's
    generation is closed, which aborts it and frees its KV."""
    n = n or len(requests)
    streams: dict[int, AsyncIterator[GenerationChunk]] = {}
    contexts: dict[int, contextvars.Context] = {}
    steps: dict[int, asyncio.Future] = {}
    loop = asyncio.get_running_loop()

    def start(i: int) -> None:
        contexts[i] = contextvars.copy_context()
        if i:
            contexts[i].run(_own_serve_request)
        streams[i] = generate(requests[i])
        step(i)

    def step(i: int) -> None:
        # `anext` in a task of its own (see `openai_api._next`): a cancellation reaches it once.
        steps[i] = loop.create_task(_anext(streams[i]), context=contexts[i])

    def taken(i: int) -> GenerationChunk:
        try:
            return steps.pop(i).result()
        except StopAsyncIteration:
            raise PdServeError(f"choice {i} ended without a finish reason") from None

    async def firsts(choices: list[int]) -> dict[int, GenerationChunk]:
        for i in choices:
            start(i)
        if choices:
            await asyncio.wait([steps[i] for i in choices], return_when=asyncio.FIRST_EXCEPTION)
        for i in choices:  # a failed choice fails the request before it is answered
            if steps[i].done() and steps[i].exception() is not None:
                taken(i)
        return {i: taken(i) for i in choices}

    try:
        leaders = list(range(0, len(requests), n))
        first = await firsts(leaders)
        first |= await firsts([i for i in range(len(requests)) if i % n])
        for i in range(len(requests)):
            yield i, first[i]
            if first[i].finish_reason is None:
                step(i)
        while steps:
            await asyncio.wait(steps.values(), return_when=asyncio.FIRST_COMPLETED)
            for i in [i for i, s in sorted(steps.items()) if s.done()]:
                chunk = taken(i)
                yield i, chunk
                if chunk.finish_reason is None:
                    step(i)
    finally:
        # Shielded: this often runs because the request was cancelled, and the closes must
        # still reach the workers.
        with anyio.CancelScope(shield=True):
            for s in steps.values():
                s.cancel()
            if steps:
                await asyncio.wait(steps.values())
            for s in steps.values():
                if not s.cancelled():
                    s.exception()  # retrieved: a failure another choice's already reported
            for stream in streams.values():
                await stream.aclose()  # type: ignore[attr-defined]


async def _anext(stream: AsyncIterator[GenerationChunk]) -> GenerationChunk:
    return await anext(stream)


def _own_serve_request() -> None:
    """Give this context's Serve request context (when there is one: inside a Serve replica)
    an internal request id of its own."""
    from ray.serve import context

    current = context._serve_request_context.get()
    if current is not None:
        own = replace(current, _internal_request_id=new_request_id())
        context._serve_request_context.set(own)
