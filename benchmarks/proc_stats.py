"""CPU accounting from /proc: the processes of the Ray this process started, their CPU time and
priority, and the load other processes put on the machine."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

_ROLE = re.compile(r"(?:ServeReplica:|SERVE_REPLICA::)([\w-]+)[:#](\w+)")


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat fields after the command name: [0] state, [1] ppid, [11] utime,
    [12] stime, [16] nice."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rindex(")") + 2 :].split()


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def serving_processes(apps: dict[str, str]) -> dict[str, int]:
    """pid of the gRPC proxy ("proxy") and of each replica of the Serve apps `apps` (app name ->
    label) as "label/Deployment", found among the workers of the raylet this process started.
    Empty if this process did not start its Ray (then no CPU accounting is reported)."""
    ppid: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid[int(entry.name)] = int(_stat(int(entry.name))[1])
            except (OSError, ValueError, IndexError):
                continue
    raylets = [p for p, pp in ppid.items() if pp == os.getpid() and _comm(p) == "raylet"]
    found: dict[str, int] = {}
    for pid, parent in ppid.items():
        if parent not in raylets:
            continue
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if title.startswith("ray::ProxyActor"):
            found["proxy"] = pid
        elif (m := _ROLE.search(title)) and m.group(1) in apps:
            found[f"{apps[m.group(1)]}/{m.group(2)}"] = pid
    return found


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """utime + stime of each process (whole ticks of SC_CLK_TCK); gone ones left out."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        try:
            f = _stat(pid)
            out[name] = (int(f[11]) + int(f[12])) / tick
        except (OSError, ValueError, IndexError):
            continue
    return out


def niceness(pid: int) -> int | None:
    try:
        return int(_stat(pid)[16])
    except (OSError, ValueError, IndexError):
        return None


class OtherLoad:
    """How much CPU other processes took since construction: busy time in /proc/stat minus
    this process's own CPU time, as a share of all CPUs. Any load skews a 2-core benchmark
    (OpenMP threads wait on descheduled peers), so the report shows it."""

    def __init__(self) -> None:
        self.wall, self.busy, self.own = time.perf_counter(), _busy_seconds(), _own_seconds()

    def share(self) -> float:
        wall = time.perf_counter() - self.wall
        other = (_busy_seconds() - self.busy) - (_own_seconds() - self.own)
        return max(0.0, other / (wall * (os.cpu_count() or 1)))


def _busy_seconds() -> float:
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system
