"""Text and stop strings off the engine's step (`OutputProcessor`) give what the step gave when
it detokenized itself, even when the processor runs steps behind the engine: the same tokens,
text and finish reasons, the tokens sampled past a stop string dropped, and every block free
once the engine took the abort."""

from __future__ import annotations

from cluster.engine.engine import Engine
from cluster.request import Request, RequestOutput, StepOutput
from tests.conftest import drive, greedy, prompt

REPLACEMENT = "\ufffd"


def _fresh_pairs(engine: Engine, tokens: list[int]) -> list[str]:
    """Texts of output pairs (i - 1, i) found in the output text only where output i ends it:
    stop strings that stop exactly at output i (spanning two tokens)."""
    found = []
    for i in range(2, len(tokens) - 2):
        pair = engine.tokenizer.decode(tokens[i - 1 : i + 1])
        upto = engine.tokenizer.decode(tokens[: i + 1])
        if pair.strip() and REPLACEMENT not in pair and upto.find(pair) == len(upto) - len(pair):
            found.append(pair)
    return found


def stop_requests(engine: Engine) -> list[Request]:
    """Requests on a greedy prompt: one that runs to max_tokens, two that stop strings end at
    different outputs, and one on another prompt whose stop string never comes."""
    vocab = engine.info.spec.vocab_size
    for seed in range(30):
        ids = prompt(12, seed=seed, vocab=vocab)
        free = drive_requests(engine, [Request(f"probe{seed}", ids, greedy(16))])
        stops = _fresh_pairs(engine, free[f"probe{seed}"].token_ids)
        if len(stops) >= 2:
            break
    else:
        raise AssertionError("no prompt with two fresh token pairs")
    return [
        Request("free", ids, greedy(16)),
        Request("stop0", ids, greedy(16, stop=(stops[0],))),
        Request("stop1", ids, greedy(16, stop=(stops[-1],))),
        Request("other", prompt(7, seed=99, vocab=vocab), greedy(12, stop=("zzzz",))),
    ]


def drive_requests(engine: Engine, requests: list[Request]) -> dict[str, RequestOutput]:
    for r in requests:
        engine.add_request(r)
    return drive(engine)


def _drive_lagging(engine: Engine, lag: int) -> tuple[dict[str, RequestOutput], int]:
    """Step an engine that does not detokenize, processing its outputs `lag` steps late and
    aborting stopped requests only then, as a busy output thread would. Returns what each
    request got and how many of the engine's outputs the processor dropped."""
    results: dict[str, RequestOutput] = {}
    behind: list[list[StepOutput]] = []
    dropped = 0
    while engine.has_work() or behind:
        if engine.has_work():
            raw = engine.step()
            assert all(out.text == "" for out in raw)  # the step made no text
            behind.append(raw)
        if len(behind) > lag or not engine.has_work():
            raw = behind.pop(0)
            outputs, stopped = engine.output_processor.process(raw)
            dropped += len(raw) - len(outputs)
            for out in outputs:
                results.setdefault(out.request_id, RequestOutput(out.request_id)).add(out)
            for rid in stopped:
                engine.abort(rid)
    return results, dropped


def test_text_made_steps_behind_the_engine_equals_text_made_in_the_step(
    tokenizer_model_dir, make_engine
):
    inline = make_engine(tokenizer_model_dir, block_size=4)
    requests = stop_requests(inline)
    want = drive_requests(inline, requests)
    assert [want[f"stop{i}"].finish_reason for i in (0, 1)] == ["stop", "stop"]
    assert len(want["stop0"].token_ids) < len(want["stop1"].token_ids) < 16
    for lag in (0, 3):
        engine = make_engine(tokenizer_model_dir, block_size=4)
        engine.detokenize_in_step = False
        for r in requests:
            engine.add_request(r)
        got, dropped = _drive_lagging(engine, lag)
        for r in requests:
            w, g = want[r.request_id], got[r.request_id]
            assert (g.token_ids, g.text, g.finish_reason) == (
                w.token_ids,
                w.text,
                w.finish_reason,
            ), (lag, r.request_id)
        if lag:  # the engine sampled past the stop strings; those tokens never went out
            assert dropped >= 2, dropped
        assert engine.stats().kv_blocks_used == 0


def _clean_first_token(engine: Engine) -> tuple[tuple[int, ...], str]:
    """A prompt whose first greedy token decodes to whole characters: (prompt, that text)."""
    for seed in range(50):
        ids = prompt(9, seed=seed, vocab=engine.info.spec.vocab_size)
        first = drive_requests(engine, [Request(f"p{seed}", ids, greedy(1))])[f"p{seed}"]
        text = engine.tokenizer.decode(first.token_ids)
        if text.strip() and REPLACEMENT not in text:
            return ids, text
    raise AssertionError("no prompt with a clean first token")


def test_a_prefilled_first_token_that_completes_a_stop_string_frees_the_held_blocks(
    tokenizer_model_dir, make_engine
):
    """On the prefill pool: the output says "stop", not "prefilled", and the engine's held
    blocks are freed by the abort instead of waiting for an export that never comes."""
    probe = make_engine(tokenizer_model_dir, block_size=4)
    ids, text = _clean_first_token(probe)
    for in_step in (True, False):
        engine = make_engine(tokenizer_model_dir, block_size=4)
        engine.detokenize_in_step = in_step
        engine.add_request(Request("r", ids, greedy(8, stop=(text,)), prefill_only=True))
        (raw,) = engine.step()
        (out,), stopped = ([raw], []) if in_step else engine.output_processor.process([raw])
        assert (out.finish_reason, out.text, len(out.token_ids)) == ("stop", "", 1)
        for rid in stopped:
            engine.abort(rid)
        assert engine.stats().kv_blocks_used == 0 and engine.stats().held == 0
        assert not engine.has_work()


def test_inline_a_stop_string_ends_the_request_in_the_step_that_found_it(
    tokenizer_model_dir, make_engine
):
    """Detokenizing in its step, the engine aborts a stopped request there and then: no later
    step is left to run for it, and no block is left."""
    engine = make_engine(tokenizer_model_dir, block_size=4)
    stopping = stop_requests(engine)[1]
    engine.add_request(stopping)
    reasons = []
    while not reasons or reasons[-1] is None:
        (out,) = engine.step()
        reasons.append(out.finish_reason)
    assert reasons[-1] == "stop" and len(reasons) < stopping.params.max_tokens
    assert not engine.has_work()
    assert engine.stats().kv_blocks_used == 0
