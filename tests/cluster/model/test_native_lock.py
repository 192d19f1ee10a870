"""torch's build lock is a plain file that a build killed mid-way leaves behind (torch then
waits on it forever); pdserve's loads hold an advisory lock of their own (`build_guard`), so a
torch lock found while holding it is a dead build's and is removed at once, while a load in
another process waits for the holder instead of racing it."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time

from cluster.model.native import GUARD, build_guard

LOAD = "from cluster.model.linear import load_packed_gemm; assert load_packed_gemm()"


def test_a_lock_left_by_a_dead_build_is_removed_inside_the_guard(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()  # fresh: age says nothing about whether its builder lives
    with build_guard(str(tmp_path)):
        assert not lock.exists()
        lock.touch()  # what torch does while it builds
    assert (tmp_path / GUARD).exists()


def test_a_load_waits_for_the_guards_holder_then_clears_a_dead_builds_lock():
    """In a fresh process (this one may have the module loaded already): while this test
    holds the guard, the load waits; released, it removes the left lock and loads."""
    from torch.utils import cpp_extension

    build = cpp_extension._get_build_directory("pdserve_packed_gemm", verbose=False)
    os.makedirs(build, exist_ok=True)
    lock = os.path.join(build, "lock")
    with open(os.path.join(build, GUARD), "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        open(lock, "w").close()
        child = subprocess.Popen([sys.executable, "-c", LOAD])
        try:
            time.sleep(3.0)
            assert child.poll() is None and os.path.exists(lock)  # waiting on the guard
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)
    assert child.wait(timeout=300) == 0
    assert not os.path.exists(lock)
