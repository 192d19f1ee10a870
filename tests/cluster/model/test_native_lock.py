"""A build lock left by a build killed mid-way is removed once it is older than any build, so
later loads do not wait on it forever; a fresh lock (a build under way) is left alone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from cluster.model.native import STALE_LOCK_S, clear_stale_lock


def test_an_old_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    clear_stale_lock(str(tmp_path))
    assert lock.exists()  # a build may hold it
    old = time.time() - STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    clear_stale_lock(str(tmp_path))
    assert not lock.exists()
    clear_stale_lock(str(tmp_path))  # no lock: nothing to do


def test_a_stale_lock_does_not_stop_the_kernels_loading():
    """In a fresh process (this one may have the module loaded already): it loads, within a
    time limit, and the lock is gone."""
    from torch.utils import cpp_extension

    build = cpp_extension._get_build_directory("pdserve_packed_gemm", verbose=False)
    lock = os.path.join(build, "lock")
    os.makedirs(build, exist_ok=True)
    open(lock, "w").close()
    old = time.time() - STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    code = "from cluster.model.linear import load_packed_gemm; assert load_packed_gemm()"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    assert not os.path.exists(lock)
