"""Every server of the cluster's inside listens on the address it was given, never on every
interface (docs/deployment.md, "Trust boundary"): here the prefill side's KV server with its
gloo sender after a transfer (whose rendezvous TCPStore, left to itself, listens on all
interfaces), and a router's token stream server, all in this process; and a wildcard
`transfer.host` is refused by the config."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cluster.config import ConfigError, TransferConfig
from router.token_stream import TokenStreamServer
from tests.cluster.kv_transfer.collective.test_collective_transport import collective_pair
from tests.cluster.kv_transfer.kv_pair import prompt, run

WILDCARDS = {"00000000", "0" * 32}  # 0.0.0.0 and :: as /proc/net/tcp{,6} write them


def listening() -> list[tuple[str, int]]:
    """This process's listening TCP sockets: (address in /proc's hex, port)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    address, port = cols[1].split(":")
                    found.append((address, int(port, 16)))
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc")
def test_no_internal_server_listens_on_every_interface(llama_dir: Path) -> None:
    async def main() -> list[tuple[str, int]]:
        tokens = TokenStreamServer("127.0.0.1")
        await tokens.start()
        try:
            async with collective_pair(llama_dir) as p:
                ids = prompt(20, 7)
                await p.fetch_and_decode(await p.prefill_handle("r1", ids), ids)
                assert p.sender._store is not None  # the rendezvous store was made
                return listening()
        finally:
            await tokens.stop()

    # Only the listeners this test opens: in a whole-suite run this process holds others,
    # of earlier tests' in-process servers (CI once found a test's grpc server on `::`).
    before = set(listening())
    sockets = [s for s in run(main()) if s not in before]
    assert len(sockets) >= 3  # KV server, TCPStore, token stream server (gloo's own, if any)
    assert not [s for s in sockets if s[0] in WILDCARDS], sockets


@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
def test_a_wildcard_transfer_host_is_refused(host: str) -> None:
    with pytest.raises(ConfigError, match="not every interface"):
        TransferConfig(host=host)
