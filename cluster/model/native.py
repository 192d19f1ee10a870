"""pdserve's C++ sources (`cluster/model/csrc`), compiled on first use into torch's extension cache.

torch's loader holds a file lock while it builds, so concurrent processes (replicas starting
together) build each module once; later processes load the cached build.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
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
