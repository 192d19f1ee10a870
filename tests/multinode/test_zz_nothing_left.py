"""Runs after the multi-node tests (files run in name order): every namespace, veth and
process their labs made is gone, whatever the tests' outcome."""

from __future__ import annotations

import time

import pytest

from tests.multinode.conftest import LAB_PREFIXES
from tests.multinode.netns_lab import leftovers

pytestmark = pytest.mark.slow


def test_the_multinode_labs_left_nothing_behind():
    if not LAB_PREFIXES:
        pytest.skip("no multi-node lab was made in this run")
    deadline = time.monotonic() + 15
    while left := [x for prefix in LAB_PREFIXES for x in leftovers(prefix)]:
        assert time.monotonic() < deadline, left
        time.sleep(0.5)
