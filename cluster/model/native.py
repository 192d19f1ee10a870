"""pdserve's C++ sources (`cluster/model/csrc`), compiled on first use into torch's extension cache.

torch's loader holds a file lock while it builds, so concurrent processes (replicas starting
together) build each module once; later processes load the cached build. That lock is a plain
file: a build killed mid-way (a replica stopped while compiling) leaves it behind, and torch
then waits on it forever at every later load. So every load here first takes an advisory lock
of its own (`flock`, which the kernel drops when its holder dies): holding it, no other pdserve
process is building, and a torch lock found then is a dead build's, removed at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("ray.serve." + __name__)

SOURCES = Path(__file__).parent / "csrc"
GUARD = "pdserve.flock"  # the advisory lock's file in each build directory


@functools.cache
def load_extension(name: str, source: str, openmp: bool = False) -> object | None:
    """The compiled module `name` built from `csrc/<source>`; None (logged once) when it cannot
    be built or loaded: no compiler, no headers, a build error, a symbol this torch lacks."""
    try:
        from torch.utils import cpp_extension

        _put_ninja_on_path()
        flags = ["-O3", "-fopenmp"] if openmp else ["-O3"]
        with build_guard(cpp_extension._get_build_directory(name, verbose=False)):
            return cpp_extension.load(
                name=name,
                sources=[str(SOURCES / source)],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"] if openmp else [],
            )
    except Exception as e:
        log.warning("native module %s unavailable, using the torch path: %s", name, e)
        return None


@contextlib.contextmanager
def build_guard(build_dir: str) -> Iterator[None]:
    """Hold this build directory's advisory lock (waiting while another process builds or
    loads); inside it, torch's own lock, if any, is a dead build's and is removed."""
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, GUARD), "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            lock = Path(build_dir) / "lock"
            if lock.exists():
                log.warning("removing the build lock a killed build left: %s", lock)
                lock.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def _put_ninja_on_path() -> None:
    """torch builds with the `ninja` found on PATH. The `ninja` package (a pdserve dependency)
    installs one beside the interpreter, which a process started without the virtual
    environment activated (a Ray worker, `/path/to/venv/bin/python -m ...`) does not see."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
