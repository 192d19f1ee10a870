"""What the fuzz tests share: one hypothesis `settings` per size of test (derandomized, so CI
runs the same cases every time, and no example database is written), the committed seed
corpus (`seeds`, `with_seeds`: every seed is an explicit `@example`), the byte-level
mutations of a valid encoding (`mutated`), and `peak_bytes`, the most Python and numpy memory
a call allocated (tracemalloc), to show a decoder sizes nothing from a claimed length."""

from __future__ import annotations

import os
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, example, settings
from hypothesis import strategies as st

CORPUS = Path(__file__).parent / "corpus"


def fuzz(max_examples: int) -> settings:
    """Settings for a fuzz test of `max_examples` cases (times `PDSERVE_FUZZ_SCALE`, for a
    long run by hand), the same cases on every run."""
    return settings(
        max_examples=max_examples * int(os.environ.get("PDSERVE_FUZZ_SCALE", "1")),
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def seeds(prefix: str) -> list[bytes]:
    """The corpus files named `prefix*`, in name order (`make_corpus` writes them)."""
    files = sorted(CORPUS.glob(f"{prefix}*"))
    assert files, f"no seed corpus for {prefix!r} in {CORPUS}"
    return [f.read_bytes() for f in files]


def with_seeds(prefix: str) -> Callable[[Any], Any]:
    """Decorate a one-argument `@given` test with an `@example` per seed of `prefix`."""

    def decorate(test):
        for seed in seeds(prefix):
            test = example(seed)(test)
        return test

    return decorate


@st.composite
def mutated(draw, valid: st.SearchStrategy[bytes]) -> bytes:
    """A valid encoding, then a few byte-level edits: flip bits, overwrite with extreme bytes,
    truncate, extend, splice in a copy of itself, or insert a run of 0xff (huge lengths)."""
    data = bytearray(draw(valid))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(("flip", "set", "truncate", "extend", "splice", "ff")))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[at] = draw(st.sampled_from((0x00, 0x7F, 0x80, 0xC1, 0xDB, 0xDD, 0xFF)))
        elif op == "truncate":
            del data[at:]
        elif op == "extend":
            data += draw(st.binary(min_size=1, max_size=16))
        elif op == "splice":
            data[at:at] = data[: draw(st.integers(0, len(data)))]
        elif op == "ff":
            data[at:at] = b"\xff" * draw(st.integers(1, 8))
    return bytes(data)


def peak_bytes(fn: Callable[[], Any]) -> int:
    """The peak of memory traced while `fn()` ran (its result or error discarded)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        try:
            fn()
        except Exception:
            pass
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
