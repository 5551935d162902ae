"""What the fault suite measures from outside a process, and the actor it reads with.

Every measurement polls with a deadline: a fault test never sleeps to
synchronise, and never waits without a bound.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import ray
import torch

import raydirect as rd
from raydirect import _runtime
from raydirect.testing import wait_read_counts
from raydirect.transports.shm import sweep_dead_segments

from actors import check_value
from helpers import rss, shm_segments

# Stated bound on how long a consumer waits to see a fault (docs/guarantees.md).
# Most faults show within a second; the bound leaves room for a loaded 2-core
# machine and for the agent's 15 s heartbeat, the slowest path (an unreachable node).
DETECT_BOUND_S = 20.0
# How long leftovers (fds, segments, stored objects) may take to go away.
SETTLE_S = 30.0


def fd_targets(pid: int) -> dict[str, str]:
    """``pid``'s open fds and what each points at (a socket, an eventfd, a file)."""
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            out[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
    return out


def settle(problem: Callable[[], str | None], timeout: float = SETTLE_S) -> None:
    """Poll until ``problem()`` is None; fail with the last problem seen."""
    deadline = time.monotonic() + timeout
    while True:
        found = problem()
        if found is None:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not back to baseline after {timeout}s: {found}")
        time.sleep(0.05)


def fd_baseline(*pids: int) -> dict[int, dict[str, str]]:
    return {pid: fd_targets(pid) for pid in pids}


def fds_back(baseline: dict[int, dict[str, str]], slack: int = 0) -> Callable[[], str | None]:
    """No surviving process holds more fds than at ``baseline`` (see ``fd_baseline``),
    give or take ``slack``."""

    def problem() -> str | None:
        grown = {}
        for pid, before in baseline.items():
            now = fd_targets(pid)
            if len(now) > len(before) + slack:
                new = sorted(t for fd, t in now.items() if before.get(fd) != t)
                grown[pid] = f"{len(before)} -> {len(now)}, new: {new}"
        return f"open fds grew: {grown}" if grown else None

    return problem


def segments_of(*pids: int) -> set[str]:
    """/dev/shm segments of these processes (other tests on this machine make their own)."""
    return {s for s in shm_segments() if s.startswith(tuple(f"rd-{pid}-" for pid in pids))}


def shm_back(baseline: set[str], *pids: int) -> Callable[[], str | None]:
    """No segment of ``pids`` beyond ``baseline``; a dead process's are swept (as
    the next raydirect process on the node does)."""

    def problem() -> str | None:
        sweep_dead_segments()
        extra = segments_of(*pids) - baseline
        return f"segments left in /dev/shm: {sorted(extra)}" if extra else None

    return problem


def store_empty(actor: Any) -> Callable[[], str | None]:
    def problem() -> str | None:
        stats = ray.get(actor.stats.remote(), timeout=30)
        if stats.num_objects or stats.num_bytes:
            return f"producer still holds {stats.num_objects} objects, {stats.num_bytes} bytes"
        return None

    return problem


def kill(pid: int) -> float:
    """SIGKILL ``pid``; returns the time.monotonic() of the kill."""
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """Freeze ``pid`` (SIGSTOP) for the block, so a fault lands mid-transfer."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def wait_for_bytes(pid: int, base_rss: int, nbytes: int, timeout: float = 60.0) -> bool:
    """Poll until ``pid``'s resident memory grew by ``nbytes`` over ``base_rss``
    (bytes landing in its receive buffer). False if it did not within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if rss(pid) - base_rss >= nbytes:
            return True
        time.sleep(0.001)
    return False


def kill_connections(port: int) -> str:
    """Abort every TCP connection to or from ``port`` on this host (both ends, with
    a reset), as a dropped link or a closed socket would. Needs CAP_NET_ADMIN."""
    cmd = ["ss", "-K", "-t", "(", "dport", "=", f":{port}", "or", "sport", "=", f":{port}", ")"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    return proc.stdout + proc.stderr


def can_kill_connections() -> str | None:
    """Why ``ss -K`` cannot abort sockets here, or None when it can."""
    import socket

    try:
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen()
            port = server.getsockname()[1]
            with socket.create_connection(("127.0.0.1", port)) as client:
                conn, _ = server.accept()
                with conn:
                    kill_connections(port)
                    try:
                        client.send(b"x")
                        client.recv(1)
                    except OSError:
                        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return f"ss -K failed: {exc}"
    return "ss -K did not abort the socket (no CAP_NET_ADMIN or no INET_DIAG_DESTROY)"


@ray.remote(num_cpus=0)
class Reader:
    """A consumer that reports failures as data (type, message, time) instead of
    raising, and keeps what it read so that its copy can be checked later."""

    def __init__(self) -> None:
        self.kept: list[Any] = []

    def pid(self) -> int:
        return os.getpid()

    def read(self, refs: list[ray.ObjectRef], transport: str | None, timeout: float) -> dict:
        try:
            values = rd.get(refs, timeout=timeout, tensor_transport=transport)
        except Exception as exc:
            return {"ok": False, "type": type(exc).__name__, "message": str(exc)}
        self.kept.extend(values)
        return {"ok": True, "summary": [_summary(v) for v in values]}

    def check_kept(self, case: str) -> str | None:
        """The copies read earlier, still intact (after their producer died, say)."""
        return next(
            (p for v in self.kept if isinstance(v, dict) and (p := check_value(case, v))), None
        )

    def drop(self) -> None:
        self.kept = []

    def agent_up(self) -> bool:
        """This process's agent, up now: the metrics thread starts it a moment
        after a first transfer (six eventfds and a listening socket), which must
        not land between a test's fd baseline and its check."""
        return _runtime.agent() is not None

    def stats(self) -> rd.LocalStats:
        return rd.local_stats()


@ray.remote(num_cpus=0)
class RegionOwner:
    """Exports one large tensor as a region (issue 40)."""

    def pid(self) -> int:
        return os.getpid()

    def export(self, nbytes: int, fill: int) -> rd.RegionHandle:
        self.tensor = torch.full((nbytes,), fill, dtype=torch.uint8)
        self.region = rd.export_region([self.tensor], name="big")
        return self.region.handle()


@ray.remote(num_cpus=0)
class RegionReader:
    """Reads a region into fresh memory (its resident size grows as bytes land),
    reporting failures as data."""

    def pid(self) -> int:
        return os.getpid()

    def read(self, handle: Any, transport: str | None, timeout: float) -> dict:
        nbytes = handle.nbytes[0]
        dest = torch.empty(nbytes, dtype=torch.uint8)  # untouched: pages appear as bytes land
        try:
            rd.read_ranges(
                handle,
                [[0, 0, nbytes, 0, 0]],
                into=dest,
                timeout=timeout,
                tensor_transport=transport,
            )
        except Exception as exc:
            return {"ok": False, "type": type(exc).__name__, "message": str(exc)}
        return {"ok": True, "first": int(dest[0]), "last": int(dest[-1])}

    def warm(self, handle: Any, transport: str | None) -> bool:
        """A read, its count settled with the owner, and this process's agent up
        (the metrics thread starts it after a first transfer) before a baseline:
        what a process makes once exists."""
        dest = torch.empty(handle.nbytes[0], dtype=torch.uint8)
        rows = [[0, 0, handle.nbytes[0], 0, 0]]
        rd.read_ranges(handle, rows, into=dest, timeout=60, tensor_transport=transport)
        _runtime.agent()
        return wait_read_counts(timeout=60)


def _summary(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return [value.numel(), int(value[1]) if value.numel() > 1 else None]
    return type(value).__name__


def stream_port(actor: Any) -> int:
    """The port of the actor's stream server (where large ``tcp`` reads move)."""
    return ray.get(
        actor.__ray_call__.remote(
            lambda self: (
                __import__("raydirect._runtime", fromlist=["agent"]).agent()
                and __import__("raydirect._stream_server", fromlist=["running"]).running().port
            )
        )
    )


def close_idle_streams(actor: Any) -> int:
    """Close the actor's pooled stream connections (so fd counts can settle)."""
    return ray.get(
        actor.__ray_call__.remote(
            lambda self: __import__("raydirect._stream_client", fromlist=["x"]).close_idle()
        )
    )


def agent_port(actor: Any) -> int:
    address = ray.get(
        actor.__ray_call__.remote(
            lambda self: __import__("raydirect._runtime", fromlist=["agent"]).agent().address
        )
    )
    return int(address.partition("/curve/")[0].rsplit(":", 1)[1])
