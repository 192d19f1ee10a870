"""The replicas a request's timing names (router/tally.py): a prefill hop's chunk never names
the decode replica, so a migration resumed on its last token still names the decode one, a
request served by its prefill alone names none, and a colocated replica is both."""

from __future__ import annotations

from tests.router.test_orchestrator import FakePools, run


def test_a_migration_resumed_on_the_last_token_names_the_decode_replica():
    chunks = run(FakePools(decode_plan=["fail-late"]), max_tokens=3)
    assert chunks[-1].timing.migrations == 1  # the last token came from the resume's prefill
    assert (chunks[-1].timing.prefill_replica, chunks[-1].timing.decode_replica) == ("p0", "d0")


def test_a_request_served_by_its_prefill_alone_names_no_decode_replica():
    last = run(FakePools(), max_tokens=1)[-1]
    assert last.finish_reason == "length" and len(last.token_ids) == 1
    assert (last.timing.prefill_replica, last.timing.decode_replica) == ("p0", "")


def test_a_colocated_replica_is_named_for_both_phases():
    for max_tokens in (1, 3):
        last = run(FakePools(), mode="colocated", max_tokens=max_tokens)[-1]
        assert (last.timing.prefill_replica, last.timing.decode_replica) == ("c0", "c0")
