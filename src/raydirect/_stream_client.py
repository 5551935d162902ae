"""The consumer's side of bulk streams (see ``_stream_server`` for the protocol).

A transfer is cut into one window per stream; each window is received by
``recv_into`` straight into the destination's memory, so the kernel's copy is
the only one. The calling thread receives the first window and watches the
producer (through its control channel, which only that thread may touch); the
others run on a shared pool. The first failure closes every socket of the
transfer, so no thread outlives it. Idle connections are pooled per producer.

How many streams (``streams_for``): ``RAYDIRECT_TCP_STREAMS`` when set (0 turns
bulk streams off: every byte then travels over the control channel's ZeroMQ
socket, one port per agent); otherwise one per ``BYTES_PER_STREAM`` of the
transfer, at most one per core and ``MAX_AUTO_STREAMS``. One stream's receive
costs a core (the kernel's copy into user memory), which is why more streams
than cores gain nothing; on a NIC that one TCP stream cannot fill (100-400
Gbit), set it to the cores you can spare.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

from raydirect._stream_server import HEADER, MAGIC, OK, window
from raydirect.errors import TransferError

BYTES_PER_STREAM = 32 << 20
MAX_AUTO_STREAMS = 4
_MAX_STREAMS = 64
_POLL_S = 0.2
_RECV_BYTES = 16 << 20  # per recv_into call: bounded time between checks
_CONNECT_TIMEOUT_S = 5.0
_IDLE_PER_PRODUCER = 8
_IDLE_TOTAL = 32
ENV_STREAMS = "RAYDIRECT_TCP_STREAMS"

# What this process received over streams: transfers, windows, connections opened.
counters: Counter[str] = Counter()
_counters_lock = threading.Lock()


def _count(key: str) -> None:
    with _counters_lock:
        counters[key] += 1


def configured_streams() -> int | None:
    """``RAYDIRECT_TCP_STREAMS`` as a number (None when unset); a bad value raises."""
    raw = os.environ.get(ENV_STREAMS, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= _MAX_STREAMS:
        raise ValueError(
            f"{ENV_STREAMS}={raw!r}: expected a whole number from 0 (bulk streams off) "
            f"to {_MAX_STREAMS}, or unset it to choose by size"
        )
    return value


def enabled() -> bool:
    return configured_streams() != 0


def streams_for(nbytes: int) -> int:
    configured = configured_streams()
    if configured:
        return configured
    cores = os.cpu_count() or 1
    return max(1, min(nbytes // BYTES_PER_STREAM, cores, MAX_AUTO_STREAMS))


class _Pool:
    """Idle connections per producer stream address, any thread; at most
    ``_IDLE_TOTAL`` in all (oldest closed first), and those whose producer hung up
    (it restarted, or closed them as idle) are closed when the pool is next used."""

    def __init__(self) -> None:
        self._idle: OrderedDict[socket.socket, tuple[str, int]] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, address: tuple[str, int]) -> socket.socket | None:
        with self._lock:
            for conn, where in reversed(self._idle.items()):
                if where == address:
                    del self._idle[conn]
                    return conn
        return None

    def give(self, address: tuple[str, int], conn: socket.socket) -> None:
        with self._lock:
            closed = _hung_up(list(self._idle))
            for old in closed:
                del self._idle[old]
            self._idle[conn] = address
            if sum(1 for a in self._idle.values() if a == address) > _IDLE_PER_PRODUCER:
                closed.append(conn)
                del self._idle[conn]
            while len(self._idle) > _IDLE_TOTAL:
                closed.append(self._idle.popitem(last=False)[0])
        for old in closed:
            old.close()

    def close_idle(self) -> int:
        with self._lock:
            idle = list(self._idle)
            self._idle.clear()
        for conn in idle:
            conn.close()
        return len(idle)


def _hung_up(conns: list[socket.socket]) -> list[socket.socket]:
    """Those of ``conns`` whose peer closed them (readable, with nothing to read)."""
    if not conns:
        return []
    readable, _, _ = select.select(conns, [], [], 0)
    gone = []
    for conn in readable:
        try:
            if not conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                gone.append(conn)
        except OSError:
            gone.append(conn)
    return gone


_pool = _Pool()


def close_idle() -> int:
    """Close this process's idle stream connections (the next read opens new ones);
    returns how many were open."""
    return _pool.close_idle()


_workers: ThreadPoolExecutor | None = None
_workers_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _workers
    with _workers_lock:
        if _workers is None:
            _workers = ThreadPoolExecutor(_MAX_STREAMS, thread_name_prefix="raydirect-stream")
        return _workers


class _Transfer:
    """One transfer's windows, sockets and first failure, shared by its threads.

    Sockets in use are in ``_sockets`` until returned to the pool; ``close`` shuts
    what is left, so no path leaks one. Window threads never raise: they record
    the first failure, which the calling thread raises without keeping it in a
    frame (an exception held by a local of a frame in its own traceback is a
    cycle that keeps the caller's ObjectRefs alive until the garbage collector
    runs, and with them the producer's copy)."""

    def __init__(
        self,
        address: tuple[str, int],
        ticket: bytes,
        deadline: float | None,
        watch: Callable[[], None],
    ) -> None:
        self.address = address
        self.ticket = ticket
        self.deadline = deadline
        self._watch = watch
        self._owner = threading.get_ident()
        self._failure: BaseException | None = None
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False

    def fail(self, exc: BaseException) -> None:
        """Record the first failure and shut every socket, so the other windows end."""
        with self._lock:
            if self._failure is None:
                self._failure = exc
            self._closed = True
            for conn in self._sockets:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            left, self._sockets = self._sockets, set()
        for conn in left:
            conn.close()

    def raise_failure(self) -> None:
        with self._lock:
            exc, self._failure = self._failure, None
        if exc is not None:
            try:
                raise exc
            finally:
                exc = None

    def _track(self, conn: socket.socket) -> None:
        with self._lock:
            if not self._closed:
                self._sockets.add(conn)
                return
        conn.close()
        raise TransferError("another stream of this transfer failed")

    def _connect(self) -> tuple[socket.socket, bool]:
        """A connection (pooled or new) and whether it came from the pool."""
        conn = _pool.take(self.address)
        pooled = conn is not None
        if conn is None:
            conn = socket.create_connection(self.address, timeout=_CONNECT_TIMEOUT_S)
            _count("connections")
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._track(conn)
        return conn, pooled

    def _open_window(self, offset: int, length: int) -> socket.socket:
        """A connection that accepted the window's request and is about to send it."""
        for _attempt in range(2):  # a pooled connection may have been closed as idle
            conn, pooled = self._connect()
            try:
                conn.settimeout(_POLL_S)
                conn.sendall(HEADER.pack(MAGIC, self.ticket, offset, length))
                status = self._recv_status(conn)
            except (ConnectionError, EOFError):
                if pooled:
                    self._drop(conn)
                    continue
                raise
            if status != OK:
                raise TransferError(
                    "the producer's stream server refused the transfer (status "
                    f"{status}): its ticket expired or was already used; read it again"
                )
            return conn
        raise ConnectionError("no connection to the producer's stream port")

    def _recv_status(self, conn: socket.socket) -> int:
        while True:
            try:
                data = conn.recv(1)
            except TimeoutError:
                self._check()
                continue
            if not data:
                raise EOFError("the stream closed before its status")
            return data[0]

    def _drop(self, conn: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(conn)
        conn.close()

    def _check(self) -> None:
        if threading.get_ident() == self._owner:
            self._watch()
        if self._closed:
            raise TransferError("another stream of this transfer failed")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise TimeoutError("the stream did not finish before the deadline")

    def receive(self, dests: list[memoryview], offset: int, length: int) -> None:
        """Receive bytes ``[offset, offset + length)`` of the transfer into ``dests``'
        concatenation at the same offsets; a failure is recorded, never raised."""
        try:
            conn = self._open_window(offset, length)
            for piece in window(dests, offset, length):
                self._fill(conn, piece)
        except BaseException as exc:
            self.fail(exc)
            return
        with self._lock:
            self._sockets.discard(conn)
        _count("windows")
        _pool.give(self.address, conn)

    def _fill(self, conn: socket.socket, piece: memoryview) -> None:
        while len(piece):
            try:
                got = conn.recv_into(piece, min(len(piece), _RECV_BYTES))
            except TimeoutError:
                self._check()
                continue
            if got == 0:
                self._check()
                raise ConnectionError("the producer closed the stream midway")
            piece = piece[got:]
            if self.deadline is not None and time.monotonic() > self.deadline:
                raise TimeoutError("the stream did not finish before the deadline")

    def wait(self, others: list[Future[None]]) -> None:
        """Until the other windows end, watching the producer from this thread."""
        for future in others:
            while not future.done():
                try:
                    self._check()
                except BaseException as exc:
                    self.fail(exc)
                    break
                futures_wait([future], timeout=_POLL_S)
        futures_wait(others)  # each ends at once after fail() shut its socket


def receive(
    address: tuple[str, int],
    ticket: bytes,
    dests: list[memoryview],
    deadline: float | None,
    watch: Callable[[], None],
) -> None:
    """Receive a ticket's bytes into ``dests`` over ``streams_for`` connections.
    ``watch`` raises if the producer is gone (called on this thread only)."""
    nbytes = sum(len(d) for d in dests)
    streams = min(streams_for(nbytes), max(1, nbytes >> 20))
    edges = [nbytes * i // streams for i in range(streams + 1)]
    transfer = _Transfer(address, ticket, deadline, watch)
    _count("transfers")
    others = [
        _executor().submit(transfer.receive, dests, edges[i], edges[i + 1] - edges[i])
        for i in range(1, streams)
    ]
    try:
        transfer.receive(dests, 0, edges[1])
        transfer.wait(others)
    finally:
        transfer.close()
    transfer.raise_failure()


def _forget_after_fork() -> None:
    # Pooled connections are the parent's (closing them here closes only our
    # copies of the descriptors); the window threads did not survive.
    global _workers, _workers_lock
    close_idle()
    _workers, _workers_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
