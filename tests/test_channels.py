"""The per-thread cache of channels to agents: what it keeps and what it closes.
Real ZeroMQ sockets on loopback; no Ray."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest
import zmq

from raydirect import _channel, _process, _wire
from raydirect._payload import ProducerInfo
from raydirect._process import start_time_of
from raydirect.errors import ProducerLostError
from raydirect.transports.base import PeerMetadata, WriteGate
from raydirect.transports.tcp import TcpTransport

from helpers import wait_for


def _unserved_address() -> str:
    """A loopback port nobody listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return _wire.agent_address(f"tcp://127.0.0.1:{port}", zmq.curve_keypair()[0], None)


def _agent() -> tuple[zmq.Socket, str]:
    """A ROUTER socket standing for an agent (CURVE, as agents are), and its address."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    public, secret = zmq.curve_keypair()
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, _wire.agent_address(f"tcp://127.0.0.1:{port}", public, None)


def test_a_channel_to_an_agent_that_never_answered_is_closed_at_the_next_use():
    """A notice sent to an agent that died before it answered leaves a channel
    that never connects; the next conversation (with another agent) closes it
    instead of keeping its sockets in the cache."""
    live, live_address = _agent()
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


def test_forget_closes_the_channels_other_threads_keep_to_a_lost_producer():
    """The consumer, on losing a producer, closes every idle channel to its agent,
    in whichever thread keeps one: a fetch-pool thread that talked to it last may
    never talk again, and its cached sockets (5 eventfds) outlived the producer."""
    agent, address = _agent()
    other_agent, other_address = _agent()
    kept: list[_channel.Channel] = []
    done = threading.Event()

    def keep_talking() -> None:  # a pool thread: alive, idle, its channels cached
        _channel.notify(address, {"op": "sent"})
        _channel.notify(other_address, {"op": "sent"})
        kept.extend(_channel._channels.channels.values())
        done.wait(30)
        _channel.close_cached()

    thread = threading.Thread(target=keep_talking)
    thread.start()
    try:
        wait_for(lambda: len(kept) == 2, timeout=10, what="the thread's two channels")
        lost, other = kept
        _channel.forget(address)
        assert lost.socket.closed and lost.monitor.closed
        assert not other.socket.closed  # a channel to a live agent stays
    finally:
        done.set()
        thread.join(10)
        agent.close(0)
        other_agent.close(0)


def test_a_producer_that_dies_just_after_its_connection_broke_is_lost_not_alive():
    """A consumer waiting for a same-node producer's answer in slices (so that a
    closed gate is noticed) sees the connection break a moment before the kernel
    shows the process dead. Which error it raises must not depend on where the
    slice ended: the grace that tells a dead producer from a broken connection runs
    to the caller's deadline (ProducerLostError, not TransferError's "read it
    again" for a producer that is gone). A real process is the producer: it dies
    0.3 s after its agent's socket closes, after the 0.1 s slice, within the grace."""
    agent, address = _agent()
    producer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    info = ProducerInfo(
        address, "node", producer.pid, start_time_of(producer.pid), b"t" * 16, "Producer.step"
    )
    link = PeerMetadata(info, b"c" * 16, time.monotonic() + 20, True, WriteGate())
    try:
        with _channel.channel(address) as ch:
            ch.send({"op": "sent"})
            agent.recv_multipart()  # connected: the agent has the consumer's message
            threading.Timer(0.3, producer.kill).start()
            agent.close(0)  # the connection breaks first, the process dies after
            with pytest.raises(ProducerLostError, match="is no longer running"):
                TcpTransport().ask_producer(ch, b"o" * 16, link)
    finally:
        producer.kill()
        producer.wait()
        for ch in _channel._channels.channels.values():
            ch.close()
        _channel._channels.channels.clear()


def test_a_same_node_producer_is_watched_through_a_pidfd():
    """Asked before every same-node read: one poll of a pidfd (1.7 us here) instead
    of reading /proc/<pid>/stat (30 us). A pid taken by another process, a zombie
    and a reaped process all read as gone."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    started = start_time_of(child.pid)
    assert _process.process_alive(child.pid, started)
    assert _process._pidfds[(child.pid, started)] >= 0  # watched through its pidfd
    assert not _process.process_alive(child.pid, started + 1)  # another process's pid
    child.stdin.close()
    wait_for(lambda: not _process.process_alive(child.pid, started), what="the child's exit")
    assert _process._pidfds[(child.pid, started)] == -1  # remembered gone, its fd closed
    child.wait()  # reaped
    assert not _process.process_alive(child.pid, started)
