"""Loading NIXL leaves the process's logging handlers open: in a Serve replica, the one that
writes the replica's log file (a first import of NIXL used to close it, silencing the log of
every prefill and decode replica from its construction on)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cluster.errors import Unavailable
from cluster.kv_transfer.nixl.nixl_pool import load_nixl

# As Serve sets up a replica's logger: a MemoryHandler in front of the log file.
CHILD = """
import logging, logging.handlers, sys
log_file = logging.FileHandler(sys.argv[1])
logger = logging.getLogger("ray.serve")
logger.addHandler(logging.handlers.MemoryHandler(1, target=log_file))
logger.setLevel(logging.INFO)
logging.getLogger("ray.serve.replica").info("before")
from cluster.kv_transfer.nixl.nixl_pool import load_nixl
load_nixl()
logging.getLogger("ray.serve.replica").info("after")
"""


def test_a_replicas_log_file_still_gets_records_after_nixl_loads(tmp_path):
    try:
        load_nixl()
    except Unavailable as e:
        pytest.skip(str(e))
    log = tmp_path / "replica.log"
    subprocess.run([sys.executable, "-c", CHILD, str(log)], check=True, timeout=120)
    assert log.read_text().splitlines() == ["before", "after"]
