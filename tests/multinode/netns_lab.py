"""`NetnsLab`: hosts of a private network on one machine, each a network namespace of its own.

A switch namespace holds a bridge; each host namespace holds one end of a veth pair (`eth0`,
an address on the lab's subnet) whose other end is a port of that bridge. The host namespaces
have no route anywhere else, and the machine's own namespace gets no address on the subnet:
what runs in a host reaches the other hosts (and its own loopback), nothing more.

Every name (namespaces, veth ends) starts with the lab's `prefix`, unique per run, and every
process started in a host carries `MARKER_ENV=prefix` in its environment, so `leftovers(prefix)`
can tell whether anything of a run is still there. `destroy` kills every process in every host
(SIGKILL, by pid, from `ip netns pids`) and deletes the namespaces (their veths go with them);
it runs at most once and is registered with atexit as soon as the first namespace exists
(SIGTERM then exits through Python, so it runs then too).

Contract: the caller is root on Linux with iproute2 (`usable()` says why not); `destroy` is
safe to call after a partial `create` and never raises.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

MARKER_ENV = "PDSERVE_NETNS_LAB"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def usable() -> str:
    """ "" if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not any((Path(d) / "ip").exists() for d in os.environ.get("PATH", "").split(":")):
        return "no `ip` (iproute2) on PATH"
    probe = f"pdprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return ""


@dataclass
class NetnsLab:
    prefix: str  # short (veth names have 15 characters at most)
    subnet: str = "10.213.47.0/24"
    hosts: dict[str, str] = field(default_factory=dict)  # host name -> address
    _made: list[str] = field(default_factory=list)  # namespaces, in creation order
    _destroyed: bool = False

    @property
    def switch(self) -> str:
        return f"{self.prefix}sw"

    def ns(self, host: str) -> str:
        return f"{self.prefix}{host}"

    def port(self, host: str) -> str:
        """The bridge port (switch side of the veth) of `host`."""
        return f"{self.prefix}{host}p"

    def create(self, hosts: Sequence[str]) -> None:
        """The switch and one namespace per host, addresses .2, .3, ... of the subnet."""
        atexit.register(self.destroy)
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # `timeout`, a CI job cancelled
            signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so finally blocks and atexit run
        net = ipaddress.ip_network(self.subnet)
        self._add_ns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, host in enumerate(hosts):
            ns, addr = self.ns(host), str(net[i + 2])
            self._add_ns(ns)
            inner, outer = f"{self.prefix}{host}v", self.port(host)
            _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", outer, "master", "br0", "up")
            _ip("-n", ns, "link", "set", inner, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{addr}/{net.prefixlen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.hosts[host] = addr

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        return {**os.environ, **(extra or {}), MARKER_ENV: self.prefix}

    def run(self, host: str, argv: Sequence[str], env=None, timeout: float = 120.0, **kw):
        """`argv` in `host`, to completion."""
        return subprocess.run(
            ["ip", "netns", "exec", self.ns(host), *argv],
            env=self.env(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            **kw,
        )

    def popen(self, host: str, argv: Sequence[str], env=None, **kw) -> subprocess.Popen:
        return subprocess.Popen(
            ["ip", "netns", "exec", self.ns(host), *argv], env=self.env(env), **kw
        )

    def pids(self, host: str) -> list[int]:
        out = _ip("netns", "pids", self.ns(host), check=False).stdout
        return [int(p) for p in out.split()]

    def kill_all(self, host: str) -> list[int]:
        """SIGKILL every process in `host` (a whole machine lost); the pids killed."""
        pids = self.pids(host)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def isolate(self, hosts: Sequence[str], on: bool) -> None:
        """Partition: isolated bridge ports do not forward to each other, only to the rest."""
        for host in hosts:
            subprocess.run(
                ["bridge", "-n", self.switch, "link", "set", "dev", self.port(host), "isolated",
                 "on" if on else "off"],
                check=True, timeout=30,
            )  # fmt: skip

    def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        for _ in range(3):  # a process may fork while the first round kills
            for ns in self._made:
                for pid in self.pids_of(ns):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)

    @staticmethod
    def pids_of(ns: str) -> list[int]:
        return [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]


def leftovers(prefix: str) -> list[str]:
    """What of a lab named `prefix` is still there: namespaces, links, live processes."""
    found = [f"netns {n}" for n in _ip("netns", "list").stdout.split() if n.startswith(prefix)]
    found += [f"link {line}" for line in _ip("-o", "link").stdout.splitlines() if prefix in line]
    marker = f"{MARKER_ENV}={prefix}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes()
            status = (proc / "stat").read_text().split()[2]
        except OSError:
            continue
        if marker in environ.split(b"\0") and status != "Z":
            found.append(f"process {proc.name}: {(proc / 'cmdline').read_bytes()[:120]!r}")
    return found
