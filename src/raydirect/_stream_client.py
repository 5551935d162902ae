"""The consumer's side of bulk streams (see ``_stream_server`` for the protocol).

A transfer is cut into one window per stream; each window is received straight
into the destination's memory (``recv_into`` in clear; encrypted, each AES-GCM
frame is decrypted into the link's buffer and copied there once authenticated,
``_frames``), so the kernel's copy (and, encrypted, the decryption and a copy
from cache) is the only pass over the bytes. The calling thread receives the
first window and watches the producer (through its control channel, which only
that thread may touch); the others run on a shared pool. The first failure
closes every socket of the transfer, so no thread outlives it. Idle connections
are pooled per producer stream port (and its TLS pin).

A stream port that is full answers ``BUSY``: the consumer tries again, backing
off, until its deadline (``BUSY_RETRY_S`` without one), then raises
``TransferError`` naming the producer.

How many streams (``streams_for``): ``RAYDIRECT_TCP_STREAMS`` when set (1-64);
otherwise one per ``BYTES_PER_STREAM`` of the transfer, at most one per core and
``MAX_AUTO_STREAMS``. One stream's receive costs a core (the kernel's copy into
user memory), which is why more streams than cores gain nothing; on a NIC that
one TCP stream cannot fill (100-400 Gbit), set it to the cores you can spare.
"""

from __future__ import annotations

import contextlib
import os
import random
import select
import socket
import ssl
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass

from raydirect._frames import Link, secure_client
from raydirect._stream_server import (
    BUSY_GREETING,
    CHALLENGE_BYTES,
    MAGIC,
    OK,
    READY,
    REQUEST,
    proof,
    window,
)
from raydirect.errors import TransferError

BYTES_PER_STREAM = 32 << 20
MAX_AUTO_STREAMS = 4
_MAX_STREAMS = 64
_POLL_S = 0.2
_CONNECT_TIMEOUT_S = 5.0
_IDLE_PER_PRODUCER = 8
_IDLE_TOTAL = 32
BUSY_RETRY_S = 60.0  # how long a consumer without a deadline retries a busy stream port
_BACKOFF_S = (0.02, 1.0)  # first and longest pause between tries, jittered
_OPEN_ATTEMPTS = 4  # connections closed before answering a window's request, at most
ENV_STREAMS = "RAYDIRECT_TCP_STREAMS"

# What this process received over streams: transfers, windows, connections opened,
# busy answers.
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
    if not 1 <= value <= _MAX_STREAMS:
        raise ValueError(
            f"{ENV_STREAMS}={raw!r}: expected a whole number of streams from 1 "
            f"to {_MAX_STREAMS}, or unset it to choose by size"
        )
    return value


def streams_for(nbytes: int) -> int:
    configured = configured_streams()
    if configured:
        return configured
    cores = os.cpu_count() or 1
    return max(1, min(nbytes // BYTES_PER_STREAM, cores, MAX_AUTO_STREAMS))


@dataclass(frozen=True)
class Peer:
    """A producer's stream port as the consumer reaches it."""

    address: tuple[str, int]
    pin: str | None  # None: in clear; else TLS, pinned (``_tls``)
    who: str  # the producer, for messages


class _Pool:
    """Idle connections per producer stream port, any thread; at most
    ``_IDLE_TOTAL`` in all (oldest closed first), and those whose producer hung up
    (it restarted, or closed them as idle) are closed when the pool is next used."""

    def __init__(self) -> None:
        self._idle: OrderedDict[Link, tuple[tuple[str, int], str | None]] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, peer: Peer) -> Link | None:
        key = (peer.address, peer.pin)
        with self._lock:
            for link, where in reversed(self._idle.items()):
                if where == key:
                    del self._idle[link]
                    return link
        return None

    def give(self, peer: Peer, link: Link) -> None:
        key = (peer.address, peer.pin)
        with self._lock:
            closed = _hung_up(list(self._idle))
            for old in closed:
                del self._idle[old]
            self._idle[link] = key
            if sum(1 for a in self._idle.values() if a == key) > _IDLE_PER_PRODUCER:
                closed.append(link)
                del self._idle[link]
            while len(self._idle) > _IDLE_TOTAL:
                closed.append(self._idle.popitem(last=False)[0])
        for old in closed:
            old.close()

    def forget_after_fork(self) -> None:
        """In a forked child: close our copies of the parent's connections. The lock
        is made anew first: a parent thread may have held it at the fork, and no
        thread here will ever release it (the child waited for ever)."""
        self._lock = threading.Lock()
        self.close_idle()

    def close_idle(self) -> int:
        with self._lock:
            idle = list(self._idle)
            self._idle.clear()
        for link in idle:
            link.close()
        return len(idle)


def _hung_up(links: list[Link]) -> list[Link]:
    """Those of ``links`` whose peer closed them. An idle connection holds the
    server's next challenge unread, so "readable" says nothing: POLLRDHUP does."""
    if not links:
        return []
    poller = select.poll()
    by_fd = {}
    for link in links:
        fd = link.sock.fileno()
        if fd < 0:
            continue
        by_fd[fd] = link
        poller.register(fd, select.POLLRDHUP)
    return [by_fd[fd] for fd, _ in poller.poll(0)]


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


class _Busy(Exception):
    """The stream port is full: try again."""


class _Transfer:
    """One transfer's windows, links and first failure, shared by its threads.

    Links in use are in ``_links`` until returned to the pool; ``close`` shuts
    what is left, so no path leaks one. Window threads never raise: they record
    the first failure, which the calling thread raises without keeping it in a
    frame (an exception held by a local of a frame in its own traceback is a
    cycle that keeps the caller's ObjectRefs alive until the garbage collector
    runs, and with them the producer's copy)."""

    def __init__(
        self,
        peer: Peer,
        ticket: bytes,
        secret: bytes,
        deadline: float | None,
        watch: Callable[[], None],
        stop: Callable[[], None],
    ) -> None:
        self.peer = peer
        self.ticket = ticket
        self.secret = secret
        self.deadline = deadline
        self._watch = watch
        self._stop = stop
        self._owner = threading.get_ident()
        self._failure: BaseException | None = None
        self._links: set[Link] = set()
        self._lock = threading.Lock()
        self._closed = False

    def fail(self, exc: BaseException) -> None:
        """Record the first failure and shut every socket, so the other windows end."""
        with self._lock:
            if self._failure is None:
                self._failure = exc
            self._closed = True
            for link in self._links:
                with contextlib.suppress(OSError):
                    link.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            left, self._links = self._links, set()
        for link in left:
            link.close()

    def raise_failure(self) -> None:
        with self._lock:
            exc, self._failure = self._failure, None
        if exc is not None:
            try:
                raise exc
            finally:
                exc = None

    def _track(self, link: Link) -> None:
        with self._lock:
            if not self._closed:
                self._links.add(link)
                return
        link.close()
        raise TransferError("another stream of this transfer failed")

    def _drop(self, link: Link) -> None:
        with self._lock:
            self._links.discard(link)
        link.close()

    def _check(self) -> None:
        """At each idle timeout of a socket (and between retries)."""
        if threading.get_ident() == self._owner:
            self._watch()
        self._between()

    def _between(self) -> None:
        """After every receive while bytes flow, on every stream's thread: cheap, so
        a call that gave up (``stop``) ends its streams within one receive."""
        if self._closed:
            raise TransferError("another stream of this transfer failed")
        self._stop()
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise TimeoutError("the stream did not finish before the deadline")

    def _dial(self) -> Link:
        """A new connection, set up (TLS where the producer encrypts); ``_Busy`` if
        the port is full."""
        timeout = _CONNECT_TIMEOUT_S
        if self.deadline is not None:
            timeout = max(0.05, min(timeout, self.deadline - time.monotonic()))
        sock = socket.create_connection(self.peer.address, timeout=timeout)
        link = Link(sock)
        self._track(link)
        _count("connections")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        greeting = link.recv_exactly(1)
        if greeting == BUSY_GREETING:
            self._drop(link)
            raise _Busy()
        if greeting != READY:
            raise ConnectionError(f"the stream port answered {greeting!r}, not a greeting")
        if self.peer.pin is not None:
            try:
                secured = secure_client(sock, self.peer.pin)
            except (ssl.SSLError, ValueError) as exc:
                raise TransferError(
                    f"TLS to the stream port of {self.peer.who} failed: {exc}"
                ) from exc
            with self._lock:
                self._links.discard(link)
            link = secured
            self._track(link)
        link.settimeout(_POLL_S)
        return link

    def _connect(self) -> Link:
        """A new connection, trying again while the port answers busy, within the
        deadline (``BUSY_RETRY_S`` without one)."""
        give_up = time.monotonic() + BUSY_RETRY_S
        if self.deadline is not None:
            give_up = min(give_up, self.deadline)
        pause = _BACKOFF_S[0]
        while True:
            try:
                return self._dial()
            except _Busy:
                _count("busy")
            if time.monotonic() + pause >= give_up:
                raise TransferError(
                    f"the stream port of {self.peer.who} stayed busy (all its connections "
                    "are transferring) until the deadline: read it again later, or read "
                    "from fewer consumers at once"
                )
            end = time.monotonic() + pause * random.uniform(0.5, 1.0)
            while time.monotonic() < end:
                self._check()
                time.sleep(min(_POLL_S, max(0.0, end - time.monotonic())))
            pause = min(pause * 2, _BACKOFF_S[1])

    def _open_window(self, offset: int, length: int) -> Link:
        """A connection that accepted the window's request and is about to send it.
        One closed before it answered (a pooled one closed as idle, or one evicted
        for a newcomer) is replaced: the window had not begun."""
        fresh = 0  # new connections tried (pooled ones that turn out closed are free)
        while True:
            link = _pool.take(self.peer)
            pooled = link is not None
            if link is None:
                fresh += 1
                link = self._connect()
            else:
                self._track(link)
            try:
                challenge = link.recv_exactly(CHALLENGE_BYTES, self._check)
                mac = proof(self.secret, challenge, self.ticket, offset, length)
                link.send(REQUEST.pack(MAGIC, self.ticket, offset, length, mac))
                status = link.recv_exactly(1, self._check)[0]
            except ConnectionError:
                self._drop(link)
                if pooled or fresh < _OPEN_ATTEMPTS:  # the pool only shrinks: bounded
                    continue
                raise
            if status != OK:
                raise TransferError(
                    f"the stream port of {self.peer.who} refused the transfer (status "
                    f"{status}): its ticket expired or was already used; read it again"
                )
            return link

    def receive(self, dests: list[memoryview], offset: int, length: int) -> None:
        """Receive bytes ``[offset, offset + length)`` of the transfer into ``dests``'
        concatenation at the same offsets; a failure is recorded, never raised."""
        try:
            link = self._open_window(offset, length)
            link.recv_pieces(window(dests, offset, length), self._check, self._between)
        except BaseException as exc:
            self.fail(exc)
            return
        _count("windows")
        if link.worn_out():  # TLS records past one key's bytes: the next window, new keys
            self._drop(link)
            return
        with self._lock:
            self._links.discard(link)
        _pool.give(self.peer, link)

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
    peer: Peer,
    ticket: bytes,
    secret: bytes,
    dests: list[memoryview],
    deadline: float | None,
    watch: Callable[[], None],
    stop: Callable[[], None] = lambda: None,
) -> None:
    """Receive a ticket's bytes into ``dests`` over ``streams_for`` connections.
    ``watch`` raises if the producer is gone (called on this thread only, when a
    socket idles); ``stop`` raises if the caller gave up (called on every stream's
    thread after every receive: it must be cheap)."""
    nbytes = sum(len(d) for d in dests)
    streams = min(streams_for(nbytes), max(1, nbytes >> 20))
    edges = [nbytes * i // streams for i in range(streams + 1)]
    transfer = _Transfer(peer, ticket, secret, deadline, watch, stop)
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
    _pool.forget_after_fork()
    _workers, _workers_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
