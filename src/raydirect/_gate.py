"""Who may talk to an agent's ROUTER at all, decided before any message is read.

* ``ZapHandler``: ZeroMQ's authentication protocol (ZAP, RFC 27). The ROUTER
  is a CURVE server; libzmq asks this handler about each client key during the
  handshake. Where Ray's token authentication is on only the cluster's client
  key (``_wire.cluster_keys``) is admitted: a process without the token never
  completes a handshake, so not one of its bytes reaches the agent's loop as a
  message. A sniffed connection cannot be replayed: every connection's session
  keys are fresh. The handler runs on a thread of its own, one key comparison
  per handshake.
* ``ConnectionCap``: at most ``MAX_CONNECTIONS`` TCP connections. libzmq keeps
  every connection it accepts, so the agent counts them from the socket's
  monitor and, over the cap, shuts the oldest one still within its handshake
  window (``HANDSHAKE_S``: libzmq closes those that do not finish in time, so an
  older one has proved itself); if there is none, the newcomer.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import threading
import time
from collections import OrderedDict

import zmq
import zmq.utils.z85
from zmq.utils.monitor import recv_monitor_message

from raydirect import _wire
from raydirect._admission import Admission, RateLimitedLog

log = logging.getLogger("raydirect")
_log = RateLimitedLog()

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
MAX_CONNECTIONS = 1024
HANDSHAKE_S = 5.0  # ZMQ_HANDSHAKE_IVL of the agent's ROUTER


class ZapHandler:
    """Answers libzmq's ZAP requests for one context (bound before the ROUTER)."""

    def __init__(self, ctx: zmq.Context, admission: Admission) -> None:
        self._admission = admission
        self._socket = ctx.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(ZAP_ENDPOINT)
        threading.Thread(target=self._run, name="raydirect-zap", daemon=True).start()

    @staticmethod
    def allowed(mechanism: bytes, credentials: list[bytes]) -> bool:
        if mechanism != b"CURVE" or not credentials:
            return False
        keys = _wire.cluster_keys()
        if keys is None:  # no token authentication in this cluster: the capability decides
            return True
        return hmac.compare_digest(credentials[0], zmq.utils.z85.decode(keys[0]))

    def _run(self) -> None:
        while True:
            try:
                parts = self._socket.recv_multipart()
                request_id, peer = parts[1], parts[3]
                ok = self.allowed(parts[5], parts[6:])
            except Exception:
                log.exception("raydirect agent: a ZAP request failed; refusing it")
                parts, request_id, peer, ok = [], b"", b"?", False
            if not ok:
                self._admission.note("unauthenticated")
                _log.warning(
                    "unauthenticated",
                    "raydirect agent: a connection from %s without the Ray cluster's key "
                    "refused at its handshake",
                    peer.decode(errors="replace"),
                )
            status = (b"200", b"OK") if ok else (b"400", b"not this cluster's key")
            with contextlib.suppress(zmq.ZMQError):
                self._socket.send_multipart([b"1.0", request_id, *status, b"", b""])


def _peer_of(fd: int) -> tuple[tuple[str, int], tuple[str, int]] | None:
    """(local, peer) addresses of the socket ``fd`` (None if it is not one)."""
    try:  # the peer may be gone, and its fd closed, before its ACCEPTED event is read
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        return sock.getsockname(), sock.getpeername()
    except OSError:
        return None
    finally:
        sock.detach()


class ConnectionCap:
    """Counts a ROUTER's connections from its monitor (``events`` to poll) and
    sheds the least proven ones over ``limit``."""

    def __init__(self, router: zmq.Socket, limit: int = MAX_CONNECTIONS) -> None:
        self.limit = limit
        self.events = router.get_monitor_socket(
            zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
        )
        self._open: OrderedDict[int, tuple[float, tuple]] = OrderedDict()  # fd -> (when, addrs)
        self.shed = 0

    def __len__(self) -> int:
        return len(self._open)

    def handle(self) -> None:
        """Read the monitor's events (from the agent's loop thread), then shed."""
        while True:
            try:
                event = recv_monitor_message(self.events, zmq.NOBLOCK)
            except zmq.Again:
                break
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                addresses = _peer_of(fd)
                if addresses is not None:
                    self._open[fd] = (time.monotonic(), addresses)
            else:
                self._open.pop(fd, None)
        while len(self._open) > self.limit:
            self._shed_one()

    def _shed_one(self) -> None:
        now = time.monotonic()
        young = [fd for fd, (when, _) in self._open.items() if now - when < HANDSHAKE_S]
        fd = young[0] if young else next(reversed(self._open))
        _, addresses = self._open.pop(fd)
        # libzmq may have closed this fd an instant ago and the number gone to a new
        # socket: shut it only if it is still the same connection.
        if _peer_of(fd) == addresses:
            sock = socket.socket(fileno=fd)
            try:
                sock.shutdown(socket.SHUT_RDWR)  # libzmq sees the end and closes it
            except OSError:
                pass
            finally:
                sock.detach()
        self.shed += 1
        _log.warning(
            "connections",
            "raydirect agent: %d connections open, more than %d: one from %s shut",
            len(self._open) + 1,
            self.limit,
            addresses[1][0] if addresses else "?",
        )

    def close(self) -> None:
        self.events.close(0)
