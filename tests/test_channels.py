"""The per-thread cache of channels to agents: what it keeps and what it closes.
Real ZeroMQ sockets on loopback; no Ray."""

from __future__ import annotations

import socket

import zmq

from raydirect import _channel, _wire

from helpers import wait_for


def _unserved_address() -> str:
    """A loopback port nobody listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return _wire.agent_address(f"tcp://127.0.0.1:{port}", zmq.curve_keypair()[0], None)


def test_a_channel_to_an_agent_that_never_answered_is_closed_at_the_next_use():
    """A notice sent to an agent that died before it answered leaves a channel
    that never connects; the next conversation (with another agent) closes it
    instead of keeping its sockets in the cache."""
    live = zmq.Context.instance().socket(zmq.ROUTER)
    live.setsockopt(zmq.LINGER, 0)
    public, secret = zmq.curve_keypair()
    live.setsockopt(zmq.CURVE_SERVER, 1)
    live.setsockopt(zmq.CURVE_SECRETKEY, secret)
    port = live.bind_to_random_port("tcp://127.0.0.1")
    live_address = _wire.agent_address(f"tcp://127.0.0.1:{port}", public, None)
    dead = _unserved_address()
    try:
        _channel.notify(dead, {"op": "sent"})
        stale = _channel._channels.channels[dead]
        wait_for(lambda: not stale.healthy(), timeout=10, what="the refused connection seen")
        _channel.notify(live_address, {"op": "sent"})
        assert dead not in _channel._channels.channels
        assert stale.socket.closed and stale.monitor.closed
        assert live_address in _channel._channels.channels
    finally:
        for ch in _channel._channels.channels.values():
            ch.close()
        _channel._channels.channels.clear()
        live.close(0)
