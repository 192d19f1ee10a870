"""pdserve's C++ sources (`cluster/model/csrc`), compiled on first use into torch's extension cache.

torch's loader holds a file lock while it builds, so concurrent processes (replicas starting
together) build each module once; later processes load the cached build.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from pathlib import Path

log = logging.getLogger("ray.serve." + __name__)

SOURCES = Path(__file__).parent / "csrc"


@functools.cache
def load_extension(name: str, source: str, openmp: bool = False) -> object | None:
    """The compiled module `name` built from `csrc/<source>`; None (logged once) when it cannot
    be built or loaded: no compiler, no headers, a build error, a symbol this torch lacks."""
    try:
        from torch.utils import cpp_extension

        _put_ninja_on_path()
        clear_stale_lock(cpp_extension._get_build_directory(name, verbose=False))
        flags = ["-O3", "-fopenmp"] if openmp else ["-O3"]
        return cpp_extension.load(
            name=name,
            sources=[str(SOURCES / source)],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"] if openmp else [],
        )
    except Exception as e:
        log.warning("native module %s unavailable, using the torch path: %s", name, e)
        return None


STALE_LOCK_S = 900.0  # far longer than any build of these kernels takes


def clear_stale_lock(build_dir: str) -> None:
    """Remove a build lock older than STALE_LOCK_S: a build killed mid-way (a replica stopped
    while compiling) leaves it behind, and torch waits on it forever at every later load."""
    lock = Path(build_dir) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return  # no lock
    if age > STALE_LOCK_S:
        log.warning("removing a stale build lock (%.0f s old): %s", age, lock)
        lock.unlink(missing_ok=True)


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
