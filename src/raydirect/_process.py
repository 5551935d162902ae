"""This process's identity, and whether another process on this node still runs.

A pid names a process only while it runs: a pid reused by a new process is
another producer. The pair (pid, start time) names one process for good, so
liveness checks and shared-memory segment names use both.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
import secrets
import select
import threading
from collections import OrderedDict


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
    """Is the process ``pid`` that started at ``start_time`` still running (same node)?

    Asked before every same-node read: reading ``/proc/<pid>/stat`` costs 30 us
    here; a pidfd, opened once per process and checked against its start time
    then, tells the same by one poll (it turns readable when the process exits,
    zombie or reaped) in a few."""
    if start_time == 0:
        return False
    fd = _pidfd(pid, start_time)
    if fd is None:  # no pidfds here (an old kernel, a seccomp filter): read /proc
        return start_time_of(pid) == start_time
    if fd < 0:
        return False
    with _pidfds_lock:  # polled under the lock: no other thread closes it meanwhile
        if _pidfds.get((pid, start_time)) != fd:  # let go (closed) since: ask /proc
            return start_time_of(pid) == start_time
        polled = _PollFd(fd, select.POLLIN, 0)
        if _poll_holding_gil(ctypes.byref(polled), 1, 0) == 0:
            return True
        _pidfds[(pid, start_time)] = -1  # gone for good: remembered, fd closed
        os.close(fd)
    return False


class _PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


# poll(2) holding the GIL (a timeout of 0 never blocks): select.poll lets the GIL
# go, and a reader beside a thread running Python then waits up to the switch
# interval (5 ms) to have it back, on every same-node read (transports.cma).
_poll_holding_gil = ctypes.PyDLL(None, use_errno=True).poll
_poll_holding_gil.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_int]
_poll_holding_gil.restype = ctypes.c_int

_PIDFDS = 64  # processes watched at once; the least recently asked about are let go
_pidfds: OrderedDict[tuple[int, int], int] = OrderedDict()  # -1: known dead
_pidfds_lock = threading.Lock()
_pidfd_open = getattr(os, "pidfd_open", None)


def _pidfd(pid: int, start_time: int) -> int | None:
    """A pidfd of the process (pid, start_time): -1 if it is gone, None if this
    system has no pidfds."""
    key = (pid, start_time)
    with _pidfds_lock:
        fd = _pidfds.get(key)
        if fd is not None:
            _pidfds.move_to_end(key)
            return fd
    if _pidfd_open is None:
        return None
    try:
        fd = _pidfd_open(pid)
    except ProcessLookupError:
        fd = -1
    except OSError:  # ENOSYS, EPERM: not here
        return None
    if fd >= 0 and start_time_of(pid) != start_time:  # the pid is another process's now
        os.close(fd)
        fd = -1
    with _pidfds_lock:
        if key in _pidfds:  # another thread was first
            if fd >= 0:
                os.close(fd)
            return _pidfds[key]
        _pidfds[key] = fd
        while len(_pidfds) > _PIDFDS:
            old = _pidfds.popitem(last=False)[1]
            if old >= 0:
                os.close(old)
    return fd


PID = os.getpid()
START_TIME = start_time_of(PID)
# Random per process: two Payloads with the same token were made in one process.
PROCESS_TOKEN = secrets.token_bytes(16)
_ID_KEY = secrets.token_bytes(32)
_ids = itertools.count()


def new_id() -> bytes:
    """A 128-bit id, unique in this process (a counter) and across processes (a
    keyed BLAKE2b of it, the key random per process). Object ids are made per
    object: ``os.urandom`` stalls at times in these VMs (42 ms once in 20,000
    calls here; median 0.55 us), the hash never does (0.8 us)."""
    return hashlib.blake2b(next(_ids).to_bytes(8, "little"), key=_ID_KEY, digest_size=16).digest()


def _new_identity() -> None:
    """A forked child is another process: its Payloads, segments and status key
    must not pass for its parent's."""
    global PID, START_TIME, PROCESS_TOKEN, _pidfds_lock, _ID_KEY
    _pidfds.clear()  # the parent's descriptors (inherited copies: left open)
    _pidfds_lock = threading.Lock()
    PID = os.getpid()
    START_TIME = start_time_of(PID)
    PROCESS_TOKEN = secrets.token_bytes(16)
    _ID_KEY = secrets.token_bytes(32)


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


# Lets the GIL go; ``transports.cma`` reads other processes' memory with it too.
# iovec arrays are built with numpy (two uint64 per vector), passed as pointers.
process_vm_readv = ctypes.CDLL(None, use_errno=True).process_vm_readv
process_vm_readv.argtypes = [
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
    ctypes.c_ulong,
    ctypes.c_ulong,
]
process_vm_readv.restype = ctypes.c_ssize_t
