"""The producer's side of bulk streams: the one path for ``tcp`` bytes above the
inline size.

Why not ZeroMQ for the bytes: over a veth pair that iperf3 fills at 2.9 GB/s in
one stream, ZeroMQ frames moved 1.1-1.8 GB/s. libzmq's I/O thread reads each
message into a buffer of its own and the consumer copies it again; one I/O
thread per context caps every transfer at one core. On a plain socket the kernel
copies straight into the consumer's receive buffer, as iperf3 does, and a
transfer split over two sockets uses two cores.

The control channel (the agent's ROUTER, CURVE-authenticated) checks the
object's capability and answers a large ``tcp`` read with a *ticket*: an id and
a secret, both 16 random bytes, naming the prepared bytes of this one transfer.
The secret travels only inside the encrypted control channel, to the consumer
that asked. A connection to the stream port then goes:

1. server: one byte in clear, ``READY``, or ``BUSY`` and close (full: see below);
2. when the agent encrypts: a TLS 1.3 handshake and the record layer (``_frames``);
3. per window: the server sends a fresh 16-byte challenge; the consumer answers
   with ``REQUEST``: magic, ticket id, offset, length and an HMAC-SHA256 of the
   challenge and those fields keyed by the ticket's secret; the server answers
   one status byte and, if ``OK``, the window's bytes.

So a ticket is honoured only on a connection whose consumer holds its secret,
and a sniffed request is worth nothing on another connection (its challenge
differs). Before authentication the server reads one fixed-size request (and
the TLS handshake, bounded by OpenSSL), looks up one dictionary key and computes
one HMAC: nothing is decoded.

A ticket ends when all its bytes were sent, when sending a window fails (the
consumer gave up), ``UNCLAIMED_TTL_S`` after it was issued if no connection has
named it, or after ``TICKET_TTL_S`` in any case.

Connections are bounded (``MAX_CONNECTIONS``). When full, a newcomer takes the
place of the oldest connection still unserved ``UNPROVEN_S`` after it connected
(its handshake or first request pending: junk, or a consumer gone quiet), else
of the oldest idle served one (consumers pool connections); only when every
connection is young or mid-transfer is the newcomer told ``BUSY``, which the
consumer retries within its deadline. A connection is
closed if it is not served within ``FIRST_REQUEST_TIMEOUT_S`` of its accept, or
idle for ``IDLE_TIMEOUT_S``.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import socket
import ssl
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from raydirect import _process
from raydirect._frames import Link, secure_server
from raydirect._tls import NONE, ServerSecurity

log = logging.getLogger("raydirect")

MAGIC = b"RDS2"
REQUEST = struct.Struct("<4s16sQQ32s")  # magic, ticket id, offset, length, proof
CHALLENGE_BYTES = 16
READY, BUSY_GREETING = b"\x00", b"\x04"
OK, UNKNOWN_TICKET, BAD_WINDOW, BAD_PROOF, BUSY = 0, 1, 2, 3, 4
_REFUSED = {UNKNOWN_TICKET: "unknown ticket", BAD_WINDOW: "bad window", BAD_PROOF: "bad proof"}
# Consumers open every window of a transfer as soon as they get its ticket, so a
# ticket no connection names for this long has no consumer left.
UNCLAIMED_TTL_S = 10.0
TICKET_TTL_S = 60.0
_SWEEP_S = 1.0  # how often expired tickets and overdue handshakes are dropped
FIRST_REQUEST_TIMEOUT_S = 5.0  # from accept to the first request served
UNPROVEN_S = 1.0  # an unserved connection this old may be evicted for a newcomer
IDLE_TIMEOUT_S = 60.0
MAX_CONNECTIONS = 256
_SEND_TIMEOUT_S = 60.0  # a consumer that stops reading for this long is dropped


def proof(secret: bytes, challenge: bytes, ticket: bytes, offset: int, length: int) -> bytes:
    """What a consumer sends for one window: HMAC-SHA256 keyed by the ticket's secret."""
    message = challenge + ticket + struct.pack("<QQ", offset, length)
    return hmac.new(secret, message, hashlib.sha256).digest()


@dataclass
class Ticket:
    views: list[memoryview]
    nbytes: int
    secret: bytes
    expires: float
    claimed_until: float  # the expiry while no connection has named it
    on_sent: Callable[[], None] | None = None
    sent: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _expired(ticket: Ticket, now: float) -> bool:
    return ticket.expires < now or ticket.claimed_until < now


NEW, IDLE, SERVING, EVICTED = "new", "idle", "serving", "evicted"


@dataclass
class _Conn:
    sock: socket.socket  # as accepted (TLS takes its fd over: ``fd`` stays valid)
    fd: int
    state: str = NEW
    since: float = field(default_factory=time.monotonic)


def _shutdown(conn: _Conn) -> None:
    """Make the connection's thread see the end of it (the thread closes it). Call
    under the server's lock while ``conn`` is listed: its fd is then still its own
    (the thread unlists it before closing it), never a number reused elsewhere."""
    sock = socket.socket(fileno=conn.fd)
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()


class StreamServer:
    """A listening socket on the node's address, one thread per open connection."""

    def __init__(self, ip: str, security: ServerSecurity | None = None) -> None:
        self._listener = socket.create_server((ip, 0), backlog=128)
        self.port: int = self._listener.getsockname()[1]
        self.security = security
        self.encryption = NONE if security is None else security.mode
        self._tickets: dict[bytes, Ticket] = {}
        self._lock = threading.Lock()
        self._conns: dict[int, _Conn] = {}  # by id(), oldest first
        self.refused: Counter[str] = Counter()  # why connections or requests were refused
        threading.Thread(target=self._accept_loop, name="raydirect-streams", daemon=True).start()

    # -- tickets
    def close_listener(self) -> None:
        self._listener.close()

    def issue(
        self, views: list[memoryview], on_sent: Callable[[], None] | None = None
    ) -> tuple[bytes, bytes, int]:
        """A ticket for the concatenation of ``views`` (kept alive until sent): its
        id, its secret and its size. ``on_sent`` is called (on a connection's
        thread) once its last byte was sent; never for a ticket that ended short."""
        ticket, secret = secrets.token_bytes(16), secrets.token_bytes(16)
        nbytes = sum(len(v) for v in views)
        self._sweep_tickets()
        now = time.monotonic()
        with self._lock:
            self._tickets[ticket] = Ticket(
                views, nbytes, secret, now + TICKET_TTL_S, now + UNCLAIMED_TTL_S, on_sent
            )
            self.issued += 1
        return ticket, secret, nbytes

    def _sweep_tickets(self) -> None:
        now = time.monotonic()
        with self._lock:
            for key in [k for k, t in self._tickets.items() if _expired(t, now)]:
                del self._tickets[key]

    def _drop(self, key: bytes) -> None:
        with self._lock:
            self._tickets.pop(key, None)

    issued = 0  # tickets issued so far

    def pending(self) -> int:
        """Tickets not yet fully sent (tests check that transfers leave none)."""
        with self._lock:
            return len(self._tickets)

    def connections(self) -> Counter[str]:
        """Open connections by state (new, idle, serving)."""
        with self._lock:
            return Counter(c.state for c in self._conns.values())

    def _claim(self, key: bytes, challenge: bytes, request: tuple) -> tuple[Ticket | None, int]:
        """The ticket a request names, if its proof holds: (ticket, status)."""
        magic, _, offset, length, mac = request
        with self._lock:
            found = self._tickets.get(key) if magic == MAGIC else None
            if found is not None and _expired(found, time.monotonic()):
                del self._tickets[key]
                found = None
        if found is None:
            return None, UNKNOWN_TICKET
        if not hmac.compare_digest(mac, proof(found.secret, challenge, key, offset, length)):
            return None, BAD_PROOF
        if offset + length > found.nbytes:
            return None, BAD_WINDOW
        found.claimed_until = found.expires  # named: the whole TTL from now on
        return found, OK

    def _sent(self, key: bytes, ticket: Ticket, nbytes: int) -> None:
        with ticket.lock:
            ticket.sent += nbytes
            done = ticket.sent >= ticket.nbytes
        if not done:
            return
        with self._lock:
            ended = self._tickets.pop(key, None)
        if ended is not None and ended.on_sent is not None:  # once: a repeated window finds none
            try:
                ended.on_sent()
            except Exception:
                log.exception("raydirect streams: a sent ticket's callback failed")

    # -- connections
    def _accept_loop(self) -> None:
        self._listener.settimeout(_SWEEP_S)
        while True:
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                self._sweep()
                continue
            except OSError:
                log.exception("raydirect streams: accept failed; still serving")
                time.sleep(0.1)  # e.g. out of fds: do not spin
                continue
            try:
                self._admit(sock)
            except Exception:
                log.exception("raydirect streams: a connection could not be admitted")
                sock.close()

    def _admit(self, sock: socket.socket) -> None:
        conn = _Conn(sock, sock.fileno())
        with self._lock:
            victim = None
            if len(self._conns) >= MAX_CONNECTIONS:
                victim = self._victim()
            full = len(self._conns) >= MAX_CONNECTIONS and victim is None
            if victim is not None:  # its slot goes to the newcomer now
                _shutdown(victim)
                self.refused[f"evicted {victim.state}"] += 1
                victim.state = EVICTED
                del self._conns[id(victim)]
            if not full:
                self._conns[id(conn)] = conn
        if full:
            self.refused["busy"] += 1
            with contextlib.suppress(OSError):
                sock.sendall(BUSY_GREETING)
            sock.close()
            return
        threading.Thread(
            target=self._serve_connection, args=(conn,), name="raydirect-stream", daemon=True
        ).start()

    def _victim(self) -> _Conn | None:
        """The connection a newcomer replaces (under ``_lock``): the oldest one still
        unserved after ``UNPROVEN_S`` (a real consumer asks within milliseconds of
        connecting), else the oldest idle one."""
        now = time.monotonic()
        for conn in self._conns.values():
            if conn.state == NEW and now - conn.since > UNPROVEN_S:
                return conn
        for conn in self._conns.values():
            if conn.state == IDLE:
                return conn
        return None

    def _sweep(self) -> None:
        self._sweep_tickets()
        now = time.monotonic()
        with self._lock:
            for conn in self._conns.values():  # a handshake or first request never done
                if conn.state == NEW and now - conn.since > FIRST_REQUEST_TIMEOUT_S:
                    self.refused["handshake timeout"] += 1
                    conn.since = now  # counted once; its thread ends it now
                    _shutdown(conn)

    def _set_state(self, conn: _Conn, state: str) -> bool:
        """False if the connection was evicted meanwhile (it must end)."""
        with self._lock:
            if conn.state == EVICTED:
                return False
            conn.state, conn.since = state, time.monotonic()
            return True

    def _serve_connection(self, conn: _Conn) -> None:
        link: Link | None = None
        try:
            sock = conn.sock
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(FIRST_REQUEST_TIMEOUT_S)
            sock.sendall(READY)
            link = Link(sock)
            if self.security is not None:
                link, _ = secure_server(sock, self.security)
            wait = FIRST_REQUEST_TIMEOUT_S
            while self._serve_window(conn, link, wait):
                wait = IDLE_TIMEOUT_S
        except ssl.SSLError as exc:
            self.refused["tls"] += 1
            log.debug("raydirect streams: a TLS handshake failed: %s", exc)
        except (OSError, ValueError):
            pass  # the consumer went away, or sent what is not a request
        except Exception:
            log.exception("raydirect streams: unexpected error on a connection")
        finally:
            with self._lock:
                self._conns.pop(id(conn), None)
            if link is not None:
                link.close()
            conn.sock.close()

    def _serve_window(self, conn: _Conn, link: Link, wait: float) -> bool:
        """Serve one request on ``link`` (arriving within ``wait`` seconds); False
        when the connection should close."""
        challenge = secrets.token_bytes(CHALLENGE_BYTES)
        link.settimeout(wait)
        link.send(challenge)
        request = REQUEST.unpack(link.recv_exactly(REQUEST.size))
        key, offset, length = request[1], request[2], request[3]
        ticket, status = self._claim(key, challenge, request)
        if ticket is None:
            self.refused[_REFUSED[status]] += 1
            with contextlib.suppress(OSError):
                link.send(bytes([status]))
            return False
        if not self._set_state(conn, SERVING):
            return False  # evicted while idle, just as this request came: the consumer retries
        link.settimeout(_SEND_TIMEOUT_S)
        try:
            link.send(bytes([OK]))
            link.send_pieces(window(ticket.views, offset, length))
        except OSError:
            self._drop(key)  # the consumer gave up on this transfer: free its bytes now
            raise
        self._sent(key, ticket, length)
        return self._set_state(conn, IDLE)


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


_server: StreamServer | None = None
_server_lock = threading.Lock()


def start(ip: str, security: ServerSecurity | None = None) -> StreamServer:
    """This process's stream server, started on first call (by the agent runtime)."""
    global _server
    with _server_lock:
        if _server is None:
            _server = StreamServer(ip, security)
        return _server


def running() -> StreamServer | None:
    return _server


def _forget_after_fork() -> None:
    # The accept thread did not survive the fork; the parent keeps listening.
    global _server, _server_lock
    if _server is not None:
        _server.close_listener()  # our copy of the descriptor
    _process.keep_from_parent(_server)
    _server, _server_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
