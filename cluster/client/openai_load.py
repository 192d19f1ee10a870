"""The load generator's OpenAI-HTTP side: the same `Workload` sent to any OpenAI-compatible
server (pdserve's HTTP port, vLLM, SGLang, ...) as streamed completions, so one command
measures pdserve and another server side by side.

Each request is one `POST {base_url}/completions` (the prompt as token ids, which vLLM and
SGLang accept too) or `POST {base_url}/chat/completions` (`chat`: the prompt as one word per
token id, so prompts that share leading ids share leading text; the server's tokenizer decides
its length), greedy, `max_tokens` as the workload says, `ignore_eos`, streamed as server-sent
events with `stream_options.include_usage`. Time to first token is the first chunk with text;
the inter-token gaps are those between text chunks; the token counts are the final chunk's
`usage` (else one per text chunk). pdserve's `pdserve_timing` on the last chunk gives the phase
timings. aiohttp (a dependency of Ray Serve, and what `vllm bench serve` uses) does the HTTP.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from cluster.client.load_generator import PhaseTiming, RequestRecord, replay
from cluster.client.progress import Progress
from cluster.client.workload import Workload, WorkloadRequest

SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]  # 70


@dataclass(frozen=True)
class OpenAITarget:
    """Where and how to send: `base_url` ends in `/v1`; `model` is the served model's id."""

    base_url: str
    model: str
    chat: bool = False
    api_key: str | None = None

    @property
    def url(self) -> str:
        path = "chat/completions" if self.chat else "completions"
        return f"{self.base_url.rstrip('/')}/{path}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class ServedModel:
    """One entry of `GET /v1/models`; `max_model_len` where the server says it (vLLM, pdserve)."""

    id: str
    max_model_len: int | None


async def served_models(
    base_url: str, api_key: str | None = None, timeout_s: float = 30.0
) -> list[ServedModel]:
    """The server's models, in its order. Raises aiohttp.ClientError or ValueError."""
    headers = OpenAITarget(base_url, "", api_key=api_key).headers
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(f"{base_url.rstrip('/')}/models", headers=headers) as resp:
            resp.raise_for_status()
            body = await resp.json()
    models = [ServedModel(m["id"], m.get("max_model_len")) for m in body.get("data", [])]
    if not models:
        raise ValueError(f"{base_url}/models lists no model")
    return models


def chat_text(token_ids: tuple[int, ...]) -> str:
    """The chat prompt standing for `token_ids`: one made-up word per id."""
    words = []
    for t in token_ids:
        word = SYLLABLES[t % 70] + SYLLABLES[t // 70 % 70]
        words.append(word + (str(t // 4900) if t >= 4900 else ""))
    return " ".join(words)


def request_body(target: OpenAITarget, req: WorkloadRequest, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.chat:
        body["messages"] = [{"role": "user", "content": chat_text(req.prompt_token_ids)}]
    else:
        body["prompt"] = list(req.prompt_token_ids)
    return body


async def run_openai_workload(
    target: OpenAITarget,
    workload: Workload,
    max_concurrency: int | None = None,
    timeout_s: float = 600.0,
    ignore_eos: bool = True,
    progress: Progress | None = None,
) -> list[RequestRecord]:
    """`load_generator.run_workload` over OpenAI HTTP: the records in workload order; a failed
    request is recorded with `HTTP_<code>` (or the exception's name) and its message."""
    connector = aiohttp.TCPConnector(limit=0)  # the workload's concurrency, not the pool's
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def send(req: WorkloadRequest, rec: RequestRecord, start: float) -> None:
            await _stream(session, target, req, rec, start, ignore_eos)

        return await replay(workload, send, max_concurrency, progress)


async def _stream(session, target, req, rec: RequestRecord, start: float, ignore_eos) -> None:
    body = request_body(target, req, ignore_eos)
    rec.sent_s = time.perf_counter() - start
    last: dict[str, Any] = {}
    try:
        async with session.post(target.url, json=body, headers=target.headers) as resp:
            if resp.status != 200:
                rec.status, rec.error = f"HTTP_{resp.status}", (await resp.text())[:500]
                return
            async for event in _events(resp):
                now = time.perf_counter() - start
                if _chunk_text(event, target.chat):
                    rec.token_times.append(now)
                last = _merge_final(last, event)
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        rec.status, rec.error = type(e).__name__, str(e)[:500]
        return
    if not rec.token_times:
        rec.status, rec.error = "UNKNOWN", "the stream ended without text"
        return
    _account(rec, last)


async def _events(resp: aiohttp.ClientResponse):
    """The JSON payloads of an SSE stream's `data:` lines, up to `[DONE]`."""
    async for raw in resp.content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            raise ValueError(f"error event: {event['error']}")
        yield event


def _chunk_text(event: dict[str, Any], chat: bool) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


def _merge_final(last: dict[str, Any], event: dict[str, Any]) -> dict[str, Any]:
    """What the stream's final chunks said: finish reason, usage, pdserve's timing (each may
    come on a chunk of its own)."""
    merged = dict(last)
    choices = event.get("choices") or []
    if choices and choices[0].get("finish_reason"):
        merged["finish_reason"] = choices[0]["finish_reason"]
    for key in ("usage", "pdserve_timing"):
        if event.get(key):
            merged[key] = event[key]
    return merged


def _account(rec: RequestRecord, last: dict[str, Any]) -> None:
    rec.finish_reason = last.get("finish_reason", "")
    usage = last.get("usage")
    if usage:
        rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
        rec.usage_output_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        rec.cached_prompt_tokens = details.get("cached_tokens") or 0
    else:
        rec.usage_output_tokens = len(rec.token_times)
    timing = last.get("pdserve_timing")
    if timing:
        rec.timing = PhaseTiming(
            *(float(timing[f"{k}_seconds"]) for k in PhaseTiming.SECONDS),
            timing.get("prefill_replica", ""),
            timing.get("decode_replica", ""),
        )
