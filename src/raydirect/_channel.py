"""The consumer's side of the control channel: DEALER sockets to producers' agents.

Consumers talk through a per-thread cache of DEALER sockets, CURVE-encrypted to
the key in the agent's address, presenting the cluster's client key
(``_wire.client_keys``). A socket monitor and ZeroMQ heartbeats (answered by the
peer's I/O thread, GIL or not) turn a dead or unreachable producer into
``ProducerLostError`` within seconds; where the producer is on this node, its
pid is checked while waiting too.

Why a connection broke (the producer died, or only the connection did) is
decided in one place, ``Channel.why_broken``, for the control channel and the
bulk streams alike, and never waits past the caller's deadline.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from raydirect import _process, _wire
from raydirect.errors import ProducerLostError, RaydirectError, TransferError

_HEARTBEAT_IVL_MS = 2000
# Generous: a loaded 2-core machine can starve an I/O thread for seconds, and a
# dead process on this node is noticed at once anyway (refused connection, pid).
_HEARTBEAT_TIMEOUT_MS = 15000
_CONNECT_TIMEOUT_MS = 5000
_HANDSHAKE_IVL_MS = 5000
_RECONNECT_IVL_MS = 100
_RECONNECT_IVL_MAX_MS = 5000  # back off from an address nobody serves any more
_CACHED_CHANNELS = 16  # per thread
# Connections refused (or answered by something that is not an agent) this many
# times in a row mean nobody serves that address any more.
_REFUSALS_BEFORE_LOST = 5
_POLL_SLICE_MS = 200
# How long a broken connection waits for evidence of the producer's death before
# calling it a broken connection to a live producer: a killed process closes its
# sockets a moment before /proc shows it dead, and its agent's connection drops
# (or its heartbeat stops) a moment after a stream broke. Never past the deadline.
LOSS_GRACE_S = 2.0
_SAME_NODE_GRACE_S = 0.5  # where the pid answers, this is enough
_GRACE_POLL_S = 0.02
_READ_AHEAD_MESSAGES = 4

_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class Channel:
    """One consumer's conversation with one producer's agent.

    "Connected" means the ZeroMQ handshake succeeded: a TCP connection alone
    can reach whatever reuses a dead agent's port (a Gloo listener, say).
    """

    # Set by the caller when the producer is on this node: checked while waiting.
    producer_alive: Callable[[], bool] | None = None

    def __init__(self, address: str) -> None:
        self.address = address
        parts = _wire.parse_address(address)
        self.endpoint, self.host, self.tls_pin = parts.endpoint, parts.host, parts.tls
        # The agent gives each connection a routing id of its own (no handover): a
        # reconnect is a new peer, and this channel then counts as broken (``lost``).
        self.socket: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
        for opt, value in (
            (zmq.RCVHWM, _READ_AHEAD_MESSAGES),
            (zmq.SNDHWM, 0),
            (zmq.LINGER, 0),
            (zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS),
            (zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS),
            (zmq.CONNECT_TIMEOUT, _CONNECT_TIMEOUT_MS),
            (zmq.HANDSHAKE_IVL, _HANDSHAKE_IVL_MS),
            (zmq.RECONNECT_IVL, _RECONNECT_IVL_MS),
            (zmq.RECONNECT_IVL_MAX, _RECONNECT_IVL_MAX_MS),
        ):
            self.socket.setsockopt(opt, value)
        public, secret = _wire.client_keys()
        for opt, key in (
            (zmq.CURVE_SERVERKEY, parts.curve_key),
            (zmq.CURVE_PUBLICKEY, public),
            (zmq.CURVE_SECRETKEY, secret),
        ):
            self.socket.setsockopt(opt, key)
        self.monitor: zmq.Socket = self.socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_CONNECT_RETRIED
            | _HANDSHAKE_FAILED
        )
        self.socket.connect(self.endpoint)
        self.connected = False
        self.refusals = 0
        self.lost = False
        self.auth_refused = False  # the agent's ZAP handler refused our key
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(0)
        self.socket.close(0)

    def _read_monitor(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected, self.refusals = True, 0
            elif event == zmq.EVENT_DISCONNECTED:
                if self.connected:
                    self.lost = True
                self.connected = False
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.auth_refused = True
                self.refusals += 1
            elif event == zmq.EVENT_CONNECT_RETRIED or event & _HANDSHAKE_FAILED:
                self.refusals += 1

    def healthy(self) -> bool:
        """Worth keeping: not lost, and not retrying an address nobody serves (a
        channel opened to an agent that died before it answered never connects,
        and would otherwise stay cached with its sockets)."""
        self._read_monitor()
        return not self.lost and not self.auth_refused and (self.connected or self.refusals == 0)

    def send(self, header: dict[str, Any]) -> None:
        self.socket.send(_wire.encode_header(header))

    def wait_readable(
        self, deadline: float | None, who: str, *, until: float | None = None
    ) -> None:
        """Block until a message is ready; ProducerLostError when the producer is
        gone, TimeoutError at ``deadline``, or earlier at ``until`` (a caller
        waiting in slices). A broken connection is judged against ``deadline``,
        not ``until``: a slice's end must not cut short the grace that tells a
        dead producer from a broken connection."""
        stop = min((t for t in (deadline, until) if t is not None), default=None)
        while True:
            timeout = _POLL_SLICE_MS
            if stop is not None:
                remaining = stop - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no answer from {who} before the deadline")
                timeout = min(timeout, max(1, int(remaining * 1000)))
            events = dict(self.poller.poll(timeout))
            if self.socket in events:
                return
            self.check_peer(who, deadline)

    def check_peer(self, who: str, deadline: float | None = None) -> None:
        """``ProducerLostError`` (or ``TransferError`` for a broken connection to a
        live producer, or a refused key) if the peer is gone; nothing while it is
        reachable."""
        self._read_monitor()
        if self.auth_refused:
            raise _wire.unauthenticated_error(who)
        if self.producer_alive is not None and not self.producer_alive():
            raise ProducerLostError.of(who, "is no longer running")
        if self.lost:
            raise self.why_broken(who, deadline, f"the connection to the agent of {who} broke")
        if not self.connected and self.refusals >= _REFUSALS_BEFORE_LOST:
            raise ProducerLostError.of(
                who, f"cannot be reached at {self.address}: its process died or restarted"
            )

    def _dead(self) -> str | None:
        """What the evidence says about the producer: how it is gone, or None."""
        self._read_monitor()
        alive = self.producer_alive
        if alive is not None:
            return None if alive() else "is no longer running"
        if self.lost:  # another node: its agent's connection dropped
            return "is unreachable: its process died or its node is down"
        if not self.connected and self.refusals >= _REFUSALS_BEFORE_LOST:
            return f"cannot be reached at {self.address}: its process died or restarted"
        return None

    def why_broken(
        self, who: str, deadline: float | None, what: str, detail: str = ""
    ) -> RaydirectError:
        """The error for a connection to the producer that broke (this channel, or
        a bulk stream): ``ProducerLostError`` once the producer is seen gone,
        ``TransferError`` ("read it again") if it is still there after a grace.
        The one place that tells the two apart; it waits at most the grace, and
        never past ``deadline``: what is known by then is what is raised."""
        grace = _SAME_NODE_GRACE_S if self.producer_alive is not None else LOSS_GRACE_S
        until = time.monotonic() + grace
        if deadline is not None:
            until = min(until, deadline)
        while True:
            gone = self._dead()
            if gone is not None:
                return ProducerLostError.of(who, gone)
            if time.monotonic() >= until:
                break
            time.sleep(_GRACE_POLL_S)
        if self.lost and self.producer_alive is None:
            return ProducerLostError.of(who, "is unreachable: its process died or its node is down")
        detail = f" ({detail})" if detail else ""
        return TransferError(
            f"{what} during the transfer{detail}; the producer is alive and still holds "
            "the object: read it again"
        )

    def recv_reply(
        self, deadline: float | None, who: str, *, until: float | None = None
    ) -> tuple[dict[str, Any], list[zmq.Frame]]:
        """The next reply: its header and frames; a refusal raises (``_wire``).
        ``until``: as for ``wait_readable``."""
        self.wait_readable(deadline, who, until=until)
        parts = self.socket.recv_multipart(copy=False)
        header = _wire.decode_header(parts[0].bytes, who)
        _wire.raise_for_refusal(header, who)
        return header, parts[1:]


class _ChannelCache(threading.local):
    def __init__(self) -> None:
        # Most recently used last; bounded so that channels to producers long
        # gone do not pile up (each keeps sockets and reconnect attempts).
        self.channels: OrderedDict[str, Channel] = OrderedDict()
        self.lock = threading.Lock()  # against ``forget`` from another thread
        with _caches_lock:
            ended = [c for c in _caches if not c[0].is_alive()]
            _caches[:] = [c for c in _caches if c[0].is_alive()]
            _caches.append((threading.current_thread(), self.channels, self.lock))
        for _thread, channels, _lock in ended:  # a thread's end leaves its channels to us
            for ch in channels.values():
                ch.close()


# Every thread's cache: ``forget`` closes the channels a dead producer left
# idle in any of them (a fetch thread that talked to it last may never talk again).
_caches: list[tuple[threading.Thread, OrderedDict[str, Channel], threading.Lock]] = []
_caches_lock = threading.Lock()
_channels = _ChannelCache()


@contextmanager
def channel(address: str) -> Iterator[Channel]:
    """A channel to ``address`` reused by this thread; closed (not reused) when the
    conversation fails midway, so no stray reply can reach the next one."""
    cache, lock = _channels.channels, _channels.lock
    with lock:
        for gone in [a for a, c in cache.items() if a != address and not c.healthy()]:
            cache.pop(gone).close()  # its agent died: nothing will use it again
        ch = cache.pop(address, None)
    if ch is not None and not ch.healthy():
        ch.close()
        ch = None
    if ch is None:
        ch = Channel(address)
    try:
        yield ch
    except BaseException:
        ch.close()
        raise
    else:
        with lock:
            old = cache.pop(address, None)
            cache[address] = ch
            extra = [cache.popitem(last=False)[1] for _ in range(len(cache) - _CACHED_CHANNELS)]
        for spare in [old, *extra]:
            if spare is not None:
                spare.close()


def forget(address: str) -> None:
    """Close the channels to ``address`` that any thread keeps idle: its agent is
    gone (a producer lost), and they would hold their sockets until that thread
    next talks, which a pool thread may never do."""
    with _caches_lock:
        caches = list(_caches)
    for _thread, cache, lock in caches:
        with lock:
            ch = cache.pop(address, None)
        if ch is not None:
            ch.close()


def close_cached() -> None:
    """Close every channel this thread keeps: for a thread about to idle, whose
    channels would otherwise hold their sockets open, to agents that may die
    meanwhile, until it next talks."""
    with _channels.lock:
        idle = list(_channels.channels.values())
        _channels.channels.clear()
    for ch in idle:
        ch.close()


def notify(address: str, header: dict[str, Any]) -> None:
    """Fire-and-forget message to an agent (no reply expected)."""
    with channel(address) as ch:
        ch.send(header)


def ask(
    address: str, header: dict[str, Any], deadline: float | None, who: str
) -> tuple[dict[str, Any], list[zmq.Frame]]:
    """Send ``header`` to an agent and return its one-message reply (header, frames)."""
    with channel(address) as ch:
        ch.send({**header, "reply": True})
        return ch.recv_reply(deadline, who)


def request(address: str, header: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Send ``header`` to an agent and return its reply's header."""
    answer, _ = ask(address, header, time.monotonic() + timeout, address)
    return answer


def _forget_after_fork() -> None:
    # The cached sockets belong to the parent's ZeroMQ context, unusable here
    # (pyzmq makes the child a context of its own).
    global _channels, _caches, _caches_lock
    _process.keep_from_parent((_channels, _caches))
    _caches, _caches_lock = [], threading.Lock()
    _channels = _ChannelCache()


os.register_at_fork(after_in_child=_forget_after_fork)
