"""Helpers shared by the single-node tests (import from here, not from conftest:
tests/multinode has a conftest of its own)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable

import zmq

from raydirect import _stream_client, _wire


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


def free_port() -> int:
    """A loopback TCP port nothing listens on (bound a moment ago, closed since)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def thread_cpu_s(pid: int, tid: int) -> float:
    """CPU seconds (user + system) thread ``tid`` of process ``pid`` has used."""
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


class Relay:
    """A TCP relay on ``host``: every connection accepted is joined to a new one to
    ``upstream`` and bytes are pumped both ways. Bytes coming down (upstream to
    client) pass through ``down(position, chunk) -> chunk`` first, where
    ``position`` counts this connection's bytes relayed down so far: a hook may
    alter them (an on-path attacker) or block (a slow link). ``close`` ends it all."""

    def __init__(
        self,
        host: str,
        upstream: tuple[str, int],
        down: Callable[[int, bytes], bytes] | None = None,
        chunk: int = 1 << 16,
    ) -> None:
        self._listener = socket.create_server((host, 0))
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._upstream = upstream
        self._down = down or (lambda position, data: data)
        self._chunk = chunk
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self.connections = 0
        self.down_bytes = 0  # relayed down, all connections
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._upstream)
            with self._lock:
                self.connections += 1
                self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, down: bool) -> None:
        position = 0
        try:
            while data := src.recv(self._chunk):
                if down:
                    data = self._down(position, data)
                    position += len(data)
                    with self._lock:
                        self.down_bytes += len(data)
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):  # either side gone: end both directions
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                sock.close()


def read_through(monkeypatch, relay: Relay) -> None:
    """This process reaches every producer's stream port through ``relay`` (until
    ``monkeypatch`` undoes it): what a proxy on the path sees and does."""
    real = _stream_client.receive

    def via_relay(peer, *args, **kwargs):
        return real(dataclasses.replace(peer, address=relay.address), *args, **kwargs)

    monkeypatch.setattr(_stream_client, "receive", via_relay)
