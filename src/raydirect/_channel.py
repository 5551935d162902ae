"""The consumer's side of the control channel: DEALER sockets to producers' agents.

Consumers talk through a per-thread cache of DEALER sockets. A socket monitor
and ZeroMQ heartbeats (answered by the peer's I/O thread, GIL or not) turn a
dead or unreachable producer into ``ProducerLostError`` within seconds; where
the producer is on this node, its pid is checked while waiting too.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from raydirect import _wire
from raydirect.errors import ProducerLostError, TransferError

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
_DEATH_GRACE_S = 0.5
# Stream messages a consumer buffers ahead of its reader (16 MiB each for tcp).
_READ_AHEAD_MESSAGES = 4

_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


_client_keys: tuple[bytes, bytes] | None = None
_client_keys_lock = threading.Lock()


def _curve_client_keys() -> tuple[bytes, bytes]:
    """This process's CURVE key pair as a client (ephemeral: agents accept any
    client key; who may read what is decided by the token proof and capabilities)."""
    global _client_keys
    with _client_keys_lock:
        if _client_keys is None:
            _client_keys = zmq.curve_keypair()
        return _client_keys


class Channel:
    """One consumer's conversation with one producer's agent.

    "Connected" means the ZeroMQ handshake succeeded: a TCP connection alone
    can reach whatever reuses a dead agent's port (a Gloo listener, say).
    """

    # Set by the caller when the producer is on this node: checked while waiting.
    producer_alive: Callable[[], bool] | None = None

    def __init__(self, address: str) -> None:
        self.address = address
        self.socket: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
        # A fixed routing id: after a reconnect the agent's replies still reach us.
        self.socket.setsockopt(zmq.ROUTING_ID, secrets.token_bytes(16))
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
        self.endpoint, server_key = _wire.split_address(address)
        if server_key is not None:
            public, secret = _curve_client_keys()
            for opt, key in (
                (zmq.CURVE_SERVERKEY, server_key),
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
            elif event == zmq.EVENT_CONNECT_RETRIED or event & _HANDSHAKE_FAILED:
                self.refusals += 1

    def healthy(self) -> bool:
        """Worth keeping: not lost, and not retrying an address nobody serves (a
        channel opened to an agent that died before it answered never connects,
        and would otherwise stay cached with its sockets)."""
        self._read_monitor()
        return not self.lost and (self.connected or self.refusals == 0)

    def send(self, header: dict[str, Any]) -> None:
        proof = _wire.auth_proof()
        if proof is not None:
            header = {**header, "auth": proof}
        self.socket.send(_wire.encode_header(header))

    def wait_readable(self, deadline: float | None, who: str) -> None:
        """Block until a message is ready; ProducerLostError when the producer is
        gone, TimeoutError at ``deadline``."""
        while True:
            timeout = _POLL_SLICE_MS
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no answer from {who} before the deadline")
                timeout = min(timeout, max(1, int(remaining * 1000)))
            events = dict(self.poller.poll(timeout))
            if self.socket in events:
                return
            self.check_peer(who)

    def check_peer(self, who: str) -> None:
        """``ProducerLostError`` (or ``TransferError`` for a broken connection to a
        live producer) if the peer is gone; nothing while it is reachable."""
        self._read_monitor()
        if self.producer_alive is not None and not self.producer_alive():
            raise ProducerLostError.of(who, "is no longer running")
        if self.lost:
            if self.producer_alive is not None and self._outlives_grace(self.producer_alive):
                # Same node and still running: only the connection broke (reset,
                # closed socket), the object is intact and a new read can succeed.
                raise TransferError(
                    f"the connection to the agent of {who} broke during the transfer; "
                    "the producer is alive and still holds the object: read it again"
                )
            raise ProducerLostError.of(who, "is unreachable: its process died or its node is down")
        if not self.connected and self.refusals >= _REFUSALS_BEFORE_LOST:
            raise ProducerLostError.of(
                who, f"cannot be reached at {self.address}: its process died or restarted"
            )

    @staticmethod
    def _outlives_grace(alive: Callable[[], bool]) -> bool:
        """A killed process closes its sockets a moment before /proc shows it dead:
        only a producer still running after a short grace counts as alive."""
        until = time.monotonic() + _DEATH_GRACE_S
        while time.monotonic() < until:
            if not alive():
                return False
            time.sleep(0.02)
        return alive()

    def recv_reply(
        self, deadline: float | None, who: str
    ) -> tuple[dict[str, Any], list[zmq.Frame]]:
        """The next reply: its header and frames; a refusal raises (``_wire``)."""
        self.wait_readable(deadline, who)
        parts = self.socket.recv_multipart(copy=False)
        header = _wire.decode_header(parts[0].bytes, who)
        _wire.raise_for_refusal(header, who)
        return header, parts[1:]

    def recv_into(self, view: memoryview, deadline: float | None, who: str) -> None:
        self.wait_readable(deadline, who)
        got = self.socket.recv_into(view)
        if got != len(view):
            raise TransferError(
                f"corrupt stream from {who}: a chunk of {got} bytes where {len(view)} were due"
            )


class _ChannelCache(threading.local):
    def __init__(self) -> None:
        # Most recently used last; bounded so that channels to producers long
        # gone do not pile up (each keeps sockets and reconnect attempts).
        self.channels: OrderedDict[str, Channel] = OrderedDict()


_channels = _ChannelCache()


@contextmanager
def channel(address: str) -> Iterator[Channel]:
    """A channel to ``address`` reused by this thread; closed (not reused) when the
    conversation fails midway, so no stray reply can reach the next one."""
    cache = _channels.channels
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
        old = cache.pop(address, None)
        if old is not None:
            old.close()
        cache[address] = ch
        while len(cache) > _CACHED_CHANNELS:
            cache.popitem(last=False)[1].close()


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
    global _channels
    _channels = _ChannelCache()


os.register_at_fork(after_in_child=_forget_after_fork)
