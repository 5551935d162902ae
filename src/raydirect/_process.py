"""This process's identity, and whether another process on this node still runs.

A pid names a process only while it runs: a pid reused by a new process is
another producer. The pair (pid, start time) names one process for good, so
liveness checks and shared-memory segment names use both.
"""

from __future__ import annotations

import ctypes
import os
import secrets


def start_time_of(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (0 if unknown or dead): with
    the pid it names one process even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    # The command name (field 2) may contain spaces, so count after ')'.
    fields = stat.rsplit(b")", 1)[1].split()
    if fields[0] in (b"Z", b"X"):  # killed but not yet reaped: its memory is gone
        return 0
    return int(fields[19])  # field 22


def process_alive(pid: int, start_time: int) -> bool:
    """Is the process ``pid`` that started at ``start_time`` still running (same node)?"""
    return start_time_of(pid) == start_time != 0


PID = os.getpid()
START_TIME = start_time_of(PID)
# Random per process: two Payloads with the same token were made in one process.
PROCESS_TOKEN = secrets.token_bytes(16)


def _new_identity() -> None:
    """A forked child is another process: its Payloads, segments and status key
    must not pass for its parent's."""
    global PID, START_TIME, PROCESS_TOKEN
    PID = os.getpid()
    START_TIME = start_time_of(PID)
    PROCESS_TOKEN = secrets.token_bytes(16)


os.register_at_fork(after_in_child=_new_identity)

# What a forked child inherited of its parent's raydirect state, kept alive for
# good: dropping it would run finalizers there (a NIXL agent's, a transport's
# segment pool's, a socket's), which act on resources the parent still uses (a
# CI run saw a NIXL agent's destructor crash the child).
_inherited: list[object] = []


def keep_from_parent(*objects: object) -> None:
    """In a forked child: never destroy these (the parent's) objects here."""
    _inherited.extend(objects)


def allow_memory_reads() -> None:
    """Let same-user processes read our memory with process_vm_readv (the cma
    transport) where Yama restricts ptrace. EINVAL where Yama is absent: nothing to do."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_ptracer, pr_set_ptracer_any = 0x59616D61, ctypes.c_ulong(-1)
        libc.prctl(pr_set_ptracer, pr_set_ptracer_any, 0, 0, 0)
    except OSError:
        pass
