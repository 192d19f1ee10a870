"""`OutputProcessor`: the engine's token outputs made text, with stop strings, off the step.

The engine's step samples tokens and ends sequences on EOS, stop ids, `max_tokens` and the
context limit; the text and the stop strings are this processor's. `Engine.step` runs it
inline (library use: `Engine.generate`, tests, benchmarks); `AsyncEngine` runs it on an output
thread of its own instead, so on a GPU the engine thread's host time per step is the step's
alone and detokenization overlaps the next step (issue 20, point 5).

Contract: `add` registers a request when the engine admits it (on the engine's thread, before
any output of it); `process` then sees every output of it, in step order, on one thread. A
stop string found in an output that did not end its sequence ends the request here: that
output goes out with finish reason "stop" and its text cut, the request id is returned for
the engine to abort (`Engine.abort`, which frees its blocks), and the engine's later outputs
for it (tokens sampled before the abort took effect, the abort's own) are dropped. A prefilled
output ("prefilled": its KV is held for export) whose first token completes a stop string goes
out as "stop" and is returned too, so the held blocks are freed instead of exported.

Fault domain: one request. An exception while making one output's text (its detokenizer, its
stop strings) fails that request alone, as the engine fails one (`StepOutput.error`, finish
reason "abort"): returned for the engine to end like a stopped one; the other outputs go on.
An output that already carries an engine error passes through and ends the request's state.
"""

from __future__ import annotations

import logging

from transformers import PreTrainedTokenizerBase

from cluster.engine.detokenizer import IncrementalDetokenizer
from cluster.errors import PdServeError
from cluster.request import StepOutput

log = logging.getLogger("ray.serve." + __name__)

# A request stopped here whose sequence the engine has not ended yet: its outputs are dropped.
_STOPPED = object()


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        # Written by `add` (engine thread), taken by `process`: one dict operation each, so
        # the two threads need no lock; the output queue between them orders add before use.
        self._new: dict[str, tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...]]] = {}
        self._detok: dict[str, IncrementalDetokenizer | object] = {}  # `process`'s thread only

    def add(
        self,
        request_id: str,
        prompt: tuple[int, ...],
        stop: tuple[str, ...],
        replay: tuple[int, ...],
    ) -> None:
        """Engine thread, at admission. `replay`: output tokens whose text was streamed already
        (a resumed generation's, a prefilled first token): decoded for context, never emitted,
        and text held back for a stop string stays held."""
        if self.tokenizer is not None:
            self._new[request_id] = (prompt[-6:], stop, replay)

    def process(self, outputs: list[StepOutput]) -> tuple[list[StepOutput], list[str]]:
        """The outputs with their text (and finish reason "stop" where a stop string ended
        one), and the ids of the requests that stop strings ended for the engine to abort."""
        if self.tokenizer is None:
            return outputs, []
        done: list[StepOutput] = []
        stopped: list[str] = []
        for out in outputs:
            try:
                processed = self._one(out, stopped)
            except Exception as e:
                processed = self._failed(out, e, stopped)
            if processed is not None:
                done.append(processed)
        return done, stopped

    def _one(self, out: StepOutput, stopped: list[str]) -> StepOutput | None:
        rid = out.request_id
        detok = self._detok.get(rid)
        if detok is _STOPPED:
            if out.finished:
                del self._detok[rid]
            return None
        if out.error is not None:  # the engine failed it: nothing more comes
            self._detok.pop(rid, None)
            self._new.pop(rid, None)
            return out
        if detok is None:  # the request's first output here
            detok = self._detokenizer(rid)
            if detok is None:  # never registered: passed on as it is
                return out
        processed = self._text(detok, out)
        if processed.finish_reason == "stop" and out.finish_reason != "stop":
            self._end(out, stopped)
        return processed

    def _failed(self, out: StepOutput, exc: Exception, stopped: list[str]) -> StepOutput:
        """`out`'s request, whose text raised `exc`, ends here with the error."""
        rid = out.request_id
        log.exception("making the text of request %s failed", rid)
        self._detok.pop(rid, None)
        self._new.pop(rid, None)
        self._end(out, stopped)
        error = PdServeError(f"making the text of request {rid!r} failed: {exc!r}")
        n_prompt, n_out = out.num_prompt_tokens, out.num_output_tokens
        return StepOutput(rid, (), "", "abort", n_prompt, n_out, error=error)

    def _end(self, out: StepOutput, stopped: list[str]) -> None:
        """`out`'s sequence ends here: returned for the engine to end, unless it has ended
        already; the outputs the engine makes of it meanwhile are dropped."""
        if out.finish_reason in (None, "prefilled"):
            stopped.append(out.request_id)
        if out.finish_reason is None:  # the sequence goes on until the abort lands
            self._detok[out.request_id] = _STOPPED

    def forget(self, request_ids: list[str]) -> None:
        """`process`'s thread: the engine dropped these requests without outputs (a failed
        step)."""
        for rid in request_ids:
            self._detok.pop(rid, None)
            self._new.pop(rid, None)

    def _detokenizer(self, rid: str) -> IncrementalDetokenizer | None:
        registered = self._new.pop(rid, None)
        if registered is None:
            return None
        prompt, stop, replay = registered
        detok = self._detok[rid] = IncrementalDetokenizer(self.tokenizer, prompt, stop, replay)
        return detok

    def _text(self, detok: IncrementalDetokenizer, out: StepOutput) -> StepOutput:
        rid, reason = out.request_id, out.finish_reason
        if reason == "abort":  # text held back for a stop string is not emitted
            del self._detok[rid]
            return out
        token_ids = out.token_ids
        for i, token in enumerate(token_ids):
            if detok.add(token):
                token_ids = token_ids[: i + 1]
                if reason in (None, "prefilled"):
                    reason = "stop"
                break
        # Text held back for a possible stop string stays held across the prefill->decode hop.
        text = detok.take(final=reason not in (None, "prefilled"))
        if reason is not None:
            del self._detok[rid]
        return StepOutput(
            rid,
            token_ids,
            text,
            reason,
            out.num_prompt_tokens,
            out.num_output_tokens,
            out.queue_seconds,
            out.num_cached_tokens,
            out.logprobs[: len(token_ids)],
        )
