"""Helpers shared by the single-node tests (import from here, not from conftest:
tests/multinode has a conftest of its own)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import zmq

from raydirect import _wire


def wait_for(predicate: Callable[[], object], timeout: float = 30.0, what: str = "") -> object:
    """Poll ``predicate`` until it returns a truthy value; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(0.05)


def shm_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("rd-")}


def rss(pid: int) -> int:
    """Resident memory of process ``pid`` (this node), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def agent_dealer(
    ctx: zmq.Context, address: str, keys: tuple[bytes, bytes] | None = None
) -> zmq.Socket:
    """A DEALER to the agent at ``address``: CURVE to its key, presenting the
    cluster's client key (or ``keys``), as a raydirect process does."""
    parts = _wire.parse_address(address)
    public, secret = keys or _wire.client_keys()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.CURVE_SERVERKEY, parts.curve_key)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.connect(parts.endpoint)
    return sock
