"""The producer's side of bulk streams: plain TCP connections for large ``tcp`` reads.

Why not ZeroMQ for the bytes: over a veth pair that iperf3 fills at 2.9 GB/s in
one stream, ZeroMQ frames moved 1.1-1.8 GB/s. libzmq's I/O thread reads each
message into a buffer of its own and the consumer copies it again; one I/O
thread per context caps every transfer at one core. On a plain socket the kernel
copies straight into the consumer's receive buffer, as iperf3 does (3.1 GB/s
here), and a transfer split over two sockets uses two cores (4.4 GB/s).

The control channel stays the agent's ROUTER: it authenticates the request and
checks the object's capability, then answers a large ``tcp`` read with a
*ticket*, 16 random bytes that name the prepared bytes of this one transfer.
The consumer opens connections to the stream port (or reuses idle ones) and on
each sends ``HEADER``: magic, ticket, offset, length; it gets one status byte
and then those bytes of the transfer. Junk costs one fixed-size read and a
dictionary lookup before the connection is closed; nothing is decoded.

A ticket ends when all its bytes were sent, when sending a window fails (the
consumer gave up), ``UNCLAIMED_TTL_S`` after it was issued if no connection has
named it (a consumer that gave up or died between the ticket and its first
window), or after ``TICKET_TTL_S`` in any case.
Connections are bounded (``MAX_CONNECTIONS``); one that never named a live
ticket is closed after ``FIRST_REQUEST_TIMEOUT_S``, an idle one after
``IDLE_TIMEOUT_S``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

log = logging.getLogger("raydirect")

MAGIC = b"RDS1"
HEADER = struct.Struct("<4s16sQQ")  # magic, ticket, offset, length
OK, UNKNOWN_TICKET, BAD_WINDOW = 0, 1, 2
# Consumers open every window of a transfer as soon as they get its ticket, so a
# ticket no connection names for this long has no consumer left.
UNCLAIMED_TTL_S = 10.0
TICKET_TTL_S = 60.0
_SWEEP_S = 5.0  # how often expired tickets (and the memory they keep) are dropped
# A new connection must name a live ticket this soon; one that has been served
# may then wait for its consumer's next transfer (consumers pool connections).
FIRST_REQUEST_TIMEOUT_S = 5.0
IDLE_TIMEOUT_S = 60.0
MAX_CONNECTIONS = 256
_SEND_TIMEOUT_S = 60.0  # a consumer that stops reading for this long is dropped


@dataclass
class Ticket:
    views: list[memoryview]
    nbytes: int
    expires: float
    claimed_until: float  # the expiry while no connection has named it
    sent: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _expired(ticket: Ticket, now: float) -> bool:
    return ticket.expires < now or ticket.claimed_until < now


class StreamServer:
    """A listening socket on the node's address, one thread per open connection."""

    def __init__(self, ip: str) -> None:
        self._listener = socket.create_server((ip, 0), backlog=128)
        self.port: int = self._listener.getsockname()[1]
        self._tickets: dict[bytes, Ticket] = {}
        self._lock = threading.Lock()
        self._open = 0
        # Connections that have not yet named a live ticket, oldest first: when all
        # MAX_CONNECTIONS are taken, the oldest of these makes room for a new one,
        # so idle junk connections cannot lock real consumers out.
        self._unnamed: OrderedDict[socket.socket, None] = OrderedDict()
        threading.Thread(target=self._accept_loop, name="raydirect-streams", daemon=True).start()

    # -- tickets
    def close_listener(self) -> None:
        self._listener.close()

    def issue(self, views: list[memoryview]) -> tuple[bytes, int]:
        """A ticket for the concatenation of ``views`` (kept alive until sent)."""
        ticket = secrets.token_bytes(16)
        nbytes = sum(len(v) for v in views)
        self._sweep()
        now = time.monotonic()
        with self._lock:
            self._tickets[ticket] = Ticket(
                views, nbytes, now + TICKET_TTL_S, claimed_until=now + UNCLAIMED_TTL_S
            )
        return ticket, nbytes

    def _sweep(self) -> None:
        now = time.monotonic()
        with self._lock:
            for key in [k for k, t in self._tickets.items() if _expired(t, now)]:
                del self._tickets[key]

    def _drop(self, key: bytes) -> None:
        with self._lock:
            self._tickets.pop(key, None)

    def pending(self) -> int:
        """Tickets not yet fully sent (tests check that transfers leave none)."""
        with self._lock:
            return len(self._tickets)

    def _claim(self, ticket: bytes) -> Ticket | None:
        with self._lock:
            found = self._tickets.get(ticket)
            if found is not None and _expired(found, time.monotonic()):
                del self._tickets[ticket]
                return None
            if found is not None:
                found.claimed_until = found.expires  # named: the whole TTL from now on
            return found

    def _sent(self, key: bytes, ticket: Ticket, nbytes: int) -> None:
        with ticket.lock:
            ticket.sent += nbytes
            done = ticket.sent >= ticket.nbytes
        if done:
            with self._lock:
                self._tickets.pop(key, None)

    # -- connections
    def _accept_loop(self) -> None:
        self._listener.settimeout(_SWEEP_S)
        while True:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                self._sweep()
                continue
            except OSError:
                log.exception("raydirect streams: accept failed; still serving")
                time.sleep(0.1)  # e.g. out of fds: do not spin
                continue
            with self._lock:
                victim = None
                if self._open >= MAX_CONNECTIONS and self._unnamed:
                    victim, _ = self._unnamed.popitem(last=False)
                full = self._open >= MAX_CONNECTIONS and victim is None
                if not full:
                    self._open += 1
                    self._unnamed[conn] = None
            if victim is not None:
                with contextlib.suppress(OSError):  # its thread ends and frees its slot
                    victim.shutdown(socket.SHUT_RDWR)
            if full:
                conn.close()
                continue
            threading.Thread(
                target=self._serve_connection, args=(conn,), name="raydirect-stream", daemon=True
            ).start()

    def _serve_connection(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            wait = FIRST_REQUEST_TIMEOUT_S
            while self._serve_window(conn, wait):
                wait = IDLE_TIMEOUT_S
        except OSError:
            pass  # the consumer went away or sent a short header: nothing to answer
        except Exception:
            log.exception("raydirect streams: unexpected error on a connection")
        finally:
            with self._lock:
                self._open -= 1
                self._unnamed.pop(conn, None)
            conn.close()

    def _serve_window(self, conn: socket.socket, wait: float) -> bool:
        """Serve one request on ``conn`` (arriving within ``wait`` seconds); False
        when the connection should close."""
        conn.settimeout(wait)
        header = _recv_exactly(conn, HEADER.size)
        if header is None:
            return False
        magic, key, offset, length = HEADER.unpack(header)
        ticket = self._claim(key) if magic == MAGIC else None
        with self._lock:
            self._unnamed.pop(conn, None)  # it spoke: served now, or closed below
        if ticket is None:
            with contextlib.suppress(OSError):
                conn.sendall(bytes([UNKNOWN_TICKET]))
            return False
        if offset + length > ticket.nbytes:
            conn.sendall(bytes([BAD_WINDOW]))
            return False
        conn.settimeout(_SEND_TIMEOUT_S)
        try:
            conn.sendall(bytes([OK]))
            for piece in window(ticket.views, offset, length):
                conn.sendall(piece)
        except OSError:
            self._drop(key)  # the consumer gave up on this transfer: free its bytes now
            raise
        self._sent(key, ticket, length)
        return True


def window(views: list[memoryview], offset: int, length: int) -> list[memoryview]:
    """The pieces of ``views``' concatenation from ``offset``, ``length`` bytes long."""
    pieces = []
    for view in views:
        size = len(view)
        if length <= 0:
            break
        if offset >= size:
            offset -= size
            continue
        take = min(size - offset, length)
        pieces.append(view[offset : offset + take])
        length -= take
        offset = 0
    return pieces


def _recv_exactly(conn: socket.socket, size: int) -> bytes | None:
    """``size`` bytes, or None if the peer closes first (or before sending any)."""
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


_server: StreamServer | None = None
_server_lock = threading.Lock()


def start(ip: str) -> StreamServer:
    """This process's stream server, started on first call (by the agent runtime)."""
    global _server
    with _server_lock:
        if _server is None:
            _server = StreamServer(ip)
        return _server


def running() -> StreamServer | None:
    return _server


def _forget_after_fork() -> None:
    # The accept thread did not survive the fork; the parent keeps listening.
    global _server, _server_lock
    if _server is not None:
        _server.close_listener()  # our copy of the descriptor
    _server, _server_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
