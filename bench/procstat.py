"""What the kernel says about a process and the machine: CPU seconds, resident memory, busy time."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of every thread of `pid` so far (/proc/<pid>/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()  # the command name may hold spaces
    return int(fields[11]) / _TICKS, int(fields[12]) / _TICKS


def cpu_seconds(pid: int) -> float:
    return sum(cpu_times(pid))


def context_switches(pid: int) -> int:
    """Context switches of all threads of `pid` so far, voluntary (a thread blocks: I/O, the GIL) and not."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/status") as handle:
                for line in handle:
                    key, _, value = line.partition(":")
                    if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
                        total += int(value)
        except FileNotFoundError:  # the thread ended meanwhile
            continue
    return total


def memory_bytes(pid: int) -> tuple[int, int]:
    """(resident now, resident peak) of `pid`, from VmRSS and VmHWM."""
    values = {}
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024
    return values["VmRSS"], values["VmHWM"]


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent not idle since boot (the first line of /proc/stat)."""
    with open("/proc/stat") as handle:
        ticks = [int(value) for value in handle.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    return (sum(ticks[:8]) - idle) / _TICKS  # guest time is already inside user time


@dataclass(frozen=True)
class Reading:
    """A process' CPU and the machine's busy time at one instant, to subtract from a later one."""

    user: float
    system: float
    switches: int
    machine: float

    @classmethod
    def now(cls, pid: int) -> "Reading":
        return cls(*cpu_times(pid), context_switches(pid), machine_busy_seconds())

    @property
    def cpu(self) -> float:
        return self.user + self.system


def machine() -> dict:
    with open("/proc/cpuinfo") as handle:
        models = [line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")]
    return {"cpus": os.cpu_count(), "cpu_model": models[0] if models else platform.processor(),
            "python": platform.python_version(), "kernel": platform.release()}
