"""Bulk streams of the ``tcp`` transport (``_stream_server`` / ``_stream_client``),
on one real Ray: the driver reads large objects over ``tcp`` from a producer actor."""

from __future__ import annotations

import socket
import time

import pytest
import ray
import torch

import raydirect as rd
from raydirect import _ray, _stream_client, _stream_server
from raydirect.transports.tcp import INLINE_MAX_BYTES

SIZE = 24 << 20  # not a multiple of any stream count used


def expected(nbytes: int, fill: int) -> torch.Tensor:
    """What actors.Producer.big makes: every 4096th byte i % 251, the rest ``fill``."""
    want = torch.full((nbytes,), fill, dtype=torch.uint8)
    marks = torch.arange(0, nbytes, 4096)
    want[marks] = (torch.arange(marks.numel()) % 251).to(torch.uint8)
    return want


def stream_port(producer) -> int:
    return ray.get(_ray.run_in_actor(producer, lambda _self: _stream_server.running().port))


def pending_tickets(producer, timeout: float = 10.0) -> int:
    """Tickets the producer still holds, once they are 0 or at the deadline (the
    server's bookkeeping runs just after its last byte was handed to the kernel)."""
    deadline = time.monotonic() + timeout
    while True:
        n = ray.get(_ray.run_in_actor(producer, lambda _self: _stream_server.running().pending()))
        if n == 0 or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


def tickets_issued(producer) -> int:
    return ray.get(_ray.run_in_actor(producer, lambda _self: _stream_server.running().issued))


def read(producer, nbytes: int, fill: int) -> tuple[torch.Tensor, dict[str, int]]:
    before = dict(_stream_client.counters)
    got = rd.get(producer.big.remote(nbytes, fill), timeout=120, tensor_transport="tcp")
    after = _stream_client.counters
    return got, {k: after[k] - before.get(k, 0) for k in ("transfers", "windows")}


@pytest.mark.parametrize("streams", [None, "1", "3"])
def test_a_large_tcp_read_arrives_exactly_over_the_streams_asked(pair, monkeypatch, streams):
    p, _ = pair
    if streams is None:
        monkeypatch.delenv(_stream_client.ENV_STREAMS, raising=False)
    else:
        monkeypatch.setenv(_stream_client.ENV_STREAMS, streams)
    want_windows = int(streams) if streams else _stream_client.streams_for(SIZE)
    got, moved = read(p, SIZE, fill=5)
    assert torch.equal(got, expected(SIZE, 5))
    assert moved == {"transfers": 1, "windows": want_windows}
    # Every ticket was used up: the producer keeps no bytes for this transfer.
    assert pending_tickets(p) == 0


def test_only_inline_objects_stay_on_the_control_channel(pair, monkeypatch):
    """One bulk path: above the inline size every object moves over the stream port
    (1 MiB too, which the ZeroMQ frames of earlier releases carried)."""
    p, _ = pair
    monkeypatch.delenv(_stream_client.ENV_STREAMS, raising=False)
    for size, transfers in ((INLINE_MAX_BYTES, 0), (INLINE_MAX_BYTES + 1, 1), (1 << 20, 1)):
        got, moved = read(p, size, fill=7)
        assert torch.equal(got, expected(size, 7))
        assert moved == {"transfers": transfers, "windows": transfers}, size
    assert pending_tickets(p) == 0


def test_connections_are_reused_between_transfers(pair, monkeypatch):
    p, _ = pair
    monkeypatch.setenv(_stream_client.ENV_STREAMS, "2")
    read(p, SIZE, fill=1)  # leaves two idle connections in the pool
    opened = _stream_client.counters["connections"]
    for fill in (2, 3):
        got, _ = read(p, SIZE, fill=fill)
        assert torch.equal(got[1:4096], expected(4096, fill)[1:])
    assert _stream_client.counters["connections"] == opened


@pytest.mark.parametrize("value", ["two", "-1", "0", "65"])
def test_a_bad_stream_count_is_refused_with_the_fix(pair, monkeypatch, value):
    p, _ = pair
    monkeypatch.setenv(_stream_client.ENV_STREAMS, value)
    with pytest.raises(Exception, match="RAYDIRECT_TCP_STREAMS") as info:
        rd.get(p.big.remote(SIZE, 1), timeout=60, tensor_transport="tcp")
    assert "from 1" in str(info.value) and "unset it" in str(info.value)


def test_junk_on_the_stream_port_is_dropped_and_serving_goes_on(pair):
    """Wrong magic, unknown tickets, garbage and silent connections: each is refused
    with a status byte (never OK) and closed; then a real transfer still arrives."""
    p, _ = pair
    port = stream_port(p)
    host = ray.get(_ray.run_in_actor(p, lambda _self: _ray.node_ip()))
    attempts = [
        _stream_server.REQUEST.pack(b"XXXX", bytes(16), 0, 1, bytes(32)),
        _stream_server.REQUEST.pack(b"RDS2", bytes(16), 0, 1 << 40, bytes(32)),
        bytes(range(256)) * 64,
    ]
    for junk in attempts:
        with socket.create_connection((host, port), timeout=10) as conn:
            conn.sendall(junk)
            got = answers(conn)
            # READY, the 16-byte challenge, then one refusal and the end.
            assert got[:1] == [0] and len(got) == 1 + _stream_server.CHALLENGE_BYTES + 1
            assert got[-1] == _stream_server.UNKNOWN_TICKET
    silent = [socket.create_connection((host, port), timeout=10) for _ in range(20)]
    got, moved = read(p, SIZE, fill=9)
    assert torch.equal(got, expected(SIZE, 9)) and moved["transfers"] == 1
    deadline = time.monotonic() + _stream_server.FIRST_REQUEST_TIMEOUT_S + 20
    for conn in silent:  # a connection that names no ticket is closed by the server
        conn.settimeout(max(0.1, deadline - time.monotonic()))
        assert answers(conn)[:1] == [0]  # greeted, challenged, then closed unserved
        conn.close()


def answers(conn: socket.socket) -> list[int]:
    """The bytes the server sends before hanging up (a reset counts as hanging up);
    a server that keeps the connection open fails the test by the socket's timeout."""
    got = b""
    try:
        while chunk := conn.recv(64):
            got += chunk
    except ConnectionResetError:
        pass
    return list(got)


def test_a_read_that_times_out_leaves_no_ticket_behind(pair, monkeypatch):
    """The consumer gives up after its deadline: the producer drops the ticket (and
    the bytes it keeps alive) when sending to the closed stream fails, or, when the
    consumer gave up before naming it, ``UNCLAIMED_TTL_S`` after issuing it."""
    p, _ = pair
    monkeypatch.setenv(_stream_client.ENV_STREAMS, "2")
    big = p.big.remote(256 << 20, 4)
    ray.wait([big])
    issued = tickets_issued(p)
    timeout = 0.001
    while tickets_issued(p) == issued:  # until a read gave up holding a ticket
        assert timeout < 5, "no read got its ticket before its deadline"
        with pytest.raises(ray.exceptions.GetTimeoutError):
            rd.get(big, timeout=timeout, tensor_transport="tcp")
        timeout *= 1.5
    assert pending_tickets(p, timeout=30) == 0
    got = rd.get(big, timeout=60, tensor_transport="tcp")  # and it reads again, whole
    assert got.numel() == 256 << 20 and int(got[1]) == 4


def test_a_ticket_no_connection_names_is_dropped_and_a_named_one_is_kept(monkeypatch):
    """In one process: a consumer that got a ticket and never came leaves nothing
    for longer than ``UNCLAIMED_TTL_S``; a ticket being sent keeps its full TTL."""
    monkeypatch.setattr(_stream_server, "UNCLAIMED_TTL_S", 0.2)
    server = _stream_server.StreamServer("127.0.0.1")
    never, never_secret, _ = server.issue([memoryview(bytes(64))])
    named, named_secret, _ = server.issue([memoryview(bytes(64))])

    def claim(ticket: bytes, secret: bytes):
        challenge = b"c" * _stream_server.CHALLENGE_BYTES
        mac = _stream_server.proof(secret, challenge, ticket, 0, 64)
        return server._claim(ticket, challenge, (_stream_server.MAGIC, ticket, 0, 64, mac))

    assert claim(named, named_secret)[1] == _stream_server.OK
    assert server.pending() == 2
    deadline = time.monotonic() + 10
    while server.pending() > 1 and time.monotonic() < deadline:
        server._sweep_tickets()
        time.sleep(0.05)
    assert server.pending() == 1
    assert claim(never, never_secret) == (None, _stream_server.UNKNOWN_TICKET)
    assert claim(named, named_secret)[1] == _stream_server.OK


CONSUMERS_PER_PROCESS = 50  # threads in the driver and in one consumer actor: 100


def test_a_hundred_tcp_consumers_of_one_producer(pair):
    """Issue 24 item 5: a trainer feeding 64+ tcp consumers locked newcomers out
    (served connections stayed pooled and counted) and the newcomer saw a raw
    EOFError. Here 100 consumers (50 threads in the driver, 50 in an actor) read
    at once from a producer whose stream port takes at most 4 connections: idle
    ones are evicted, the rest told busy and retried, and every read arrives."""
    p, c = pair

    def read_many(_self, refs: list, threads: int) -> dict[str, int]:
        """Read every ref at once, one thread each (each thread has its own control
        channel and stream connections); what arrived exact, and what was raised."""
        from concurrent.futures import ThreadPoolExecutor

        def one(ref) -> str:
            try:
                got = rd.get(ref, timeout=120, tensor_transport="tcp")
            except Exception as exc:  # every failure is counted by type
                return f"{type(exc).__name__}: {str(exc)[:200]}"
            return "exact" if got.numel() == 1 << 20 and int(got[1]) == 3 else "wrong"

        with ThreadPoolExecutor(threads) as pool:
            outcomes = list(pool.map(one, refs))
        return {k: outcomes.count(k) for k in set(outcomes)}

    ray.get(_ray.run_in_actor(p, lambda _self: setattr(_stream_server, "MAX_CONNECTIONS", 4)))
    try:
        refs = [p.big.remote(1 << 20, 3) for _ in range(2 * CONSUMERS_PER_PROCESS)]
        ray.wait(refs, num_returns=len(refs))
        mine, theirs = refs[:CONSUMERS_PER_PROCESS], refs[CONSUMERS_PER_PROCESS:]
        actor_run = _ray.run_in_actor(c, read_many, theirs, CONSUMERS_PER_PROCESS)
        here = read_many(None, mine, CONSUMERS_PER_PROCESS)
        there = ray.get(actor_run, timeout=300)
        assert here == {"exact": CONSUMERS_PER_PROCESS}, here
        assert there == {"exact": CONSUMERS_PER_PROCESS}, there
        refused = ray.get(
            _ray.run_in_actor(p, lambda _self: dict(_stream_server.running().refused))
        )
        print("stream port refusals with 100 consumers:", refused)
        assert refused.get("evicted idle", 0) + refused.get("busy", 0) > 0, refused
    finally:
        ray.get(_ray.run_in_actor(p, lambda _self: setattr(_stream_server, "MAX_CONNECTIONS", 256)))
    assert pending_tickets(p) == 0
