"""Processes killed before, during and after a transfer: a clear error within a
bound, and nothing left behind in the processes that survive.

Faults land mid-transfer deterministically: the driver watches the consumer's
resident memory grow as bytes land in its receive buffer, freezes it
(SIGSTOP), checks that the transfer is unfinished, injects the fault, and lets
it go on. Each case records the time from the fault to the error the user
sees, printed as ``FAULT <case> <seconds>`` (collected in docs/guarantees.md).

Covered elsewhere, not repeated here: a gloo group member killed during a
transfer (tests/test_groups.py::test_member_killed_during_a_transfer), a
restarted producer (tests/test_lifetime.py), a Ray node removed while its
objects are referenced (tests/multinode/test_node_loss.py).
"""

from __future__ import annotations

import time

import pytest
import ray
from probes import (
    DETECT_BOUND_S,
    Reader,
    can_kill_connections,
    close_idle_streams,
    fd_baseline,
    fds_back,
    kill,
    kill_connections,
    rss,
    segments_of,
    settle,
    shm_back,
    stopped,
    store_empty,
    stream_port,
    wait_for_bytes,
)

from actors import Producer, check_value

CHANNEL_FDS = 2  # what one cached consumer channel may hold (its socket, its monitor)
BIG = 1 << 30  # 1 GiB: long enough (0.15-1 s) to freeze the consumer inside it
STARTED = 96 << 20  # bytes landed before the fault: the transfer is under way
ATTEMPTS = 20  # a loaded machine may finish before the freeze: try again
TRANSPORTS = ["tcp", "cma", "shm"]


def report(case: str, seconds: float) -> None:
    print(f"FAULT {case} {seconds:.3f}")


@pytest.fixture
def reader(ray_session):
    r = Reader.remote()
    pid = ray.get(r.pid.remote())
    yield r, pid
    ray.kill(r)


def warm(producer, reader, transport: str) -> None:
    """Reads before the baseline, so that what each process makes once exists:
    channels, ZeroMQ contexts (pyzmq starts a second one, with its threads, for
    its first zero-copy send: a 1 MiB object is streamed, not inlined), and the
    reader's own agent (which a receiving process starts in the background)."""
    # Several refs at once (fetch threads, and up to four agent threads serving
    # them, each with its socket), then one (read on the actor's own thread).
    refs = [producer.big.remote(1 << 20, i) for i in range(6)]
    for batch in (refs, refs[:1]):
        result = ray.get(reader.read.remote(batch, transport, 60))
        assert result["ok"], result
    assert ray.get(reader.agent_up.remote())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("phase", ["before", "after"])
def test_producer_killed_before_or_after_a_transfer(reader, phase):
    """One producer, one object per transport; killed before any read, or after
    each was read once. Every read after the death fails fast and cleanly."""
    r, r_pid = reader
    p = Producer.remote()
    p_pid = ray.get(p.pid.remote())
    for transport in TRANSPORTS:
        warm(p, r, transport)
    refs = {t: p.value.remote("large") for t in TRANSPORTS}  # direct objects
    ray.wait(list(refs.values()), num_returns=len(refs))
    if phase == "after":
        for transport, ref in refs.items():
            assert ray.get(r.read.remote([ref], transport, 60))["ok"]
    baseline = fd_baseline(r_pid)
    shm_before = segments_of(r_pid)

    kill(p_pid)
    for transport, ref in refs.items():
        t0 = time.monotonic()
        result = ray.get(r.read.remote([ref], transport, 120), timeout=120)
        seconds = time.monotonic() - t0
        report(f"producer_killed_{phase}_{transport}", seconds)
        assert not result["ok"] and result["type"] == "ProducerLostError", result
        assert "Re-run the producer" in result["message"], result
        assert "Producer.value" in result["message"], result
        assert seconds < DETECT_BOUND_S
    if phase == "after":  # what arrived before the death is the consumer's own, intact
        assert ray.get(r.check_kept.remote("large")) is None
    settle(fds_back(baseline))
    settle(shm_back(shm_before, p_pid, r_pid))
    assert ray.get(r.stats.remote()).num_objects == 0


def _start_big_read(p, r, r_pid: int, transport: str, fill: int):
    """Start reading a 1 GiB object and freeze the reader mid-transfer. Returns the
    pending read and the ref, with the reader stopped, or None if it finished first."""
    for _ in range(ATTEMPTS):
        big = p.big.remote(BIG, fill)
        ray.wait([big])
        base = rss(r_pid)
        pending = r.read.remote([big], transport, 300)
        assert wait_for_bytes(r_pid, base, STARTED), "the transfer never started"
        stop = stopped(r_pid)
        stop.__enter__()
        if rss(r_pid) - base < BIG - 2 * STARTED:  # well short of the end: mid-transfer
            return pending, big, stop
        stop.__exit__(None, None, None)
        assert ray.get(pending, timeout=300)["ok"]
        ray.get(r.drop.remote())
        del big
    raise AssertionError(f"the transfer outran the freeze {ATTEMPTS} times: no fault landed in it")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["tcp", "cma"])
def test_producer_killed_during_a_large_transfer(reader, transport):
    r, r_pid = reader
    p = Producer.remote()
    p_pid = ray.get(p.pid.remote())
    warm(p, r, transport)
    baseline = fd_baseline(r_pid)
    shm_before = segments_of(r_pid)

    pending, big, stop = _start_big_read(p, r, r_pid, transport, 5)
    try:
        t0 = kill(p_pid)
    finally:
        stop.__exit__(None, None, None)
    result = ray.get(pending, timeout=300)
    seconds = time.monotonic() - t0
    report(f"producer_killed_during_{transport}", seconds)

    assert not result["ok"] and result["type"] == "ProducerLostError", result
    assert "Re-run the producer" in result["message"]
    assert seconds < DETECT_BOUND_S
    del big
    settle(fds_back(baseline))
    settle(shm_back(shm_before, p_pid, r_pid))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["tcp", "cma"])
def test_consumer_killed_during_a_large_transfer(reader, transport):
    r, r_pid = reader
    p = Producer.remote()
    p_pid = ray.get(p.pid.remote())
    warm(p, r, transport)
    settle(store_empty(p))
    baseline = fd_baseline(p_pid)
    shm_before = segments_of(p_pid)

    pending, big, stop = _start_big_read(p, r, r_pid, transport, 6)
    try:
        kill(r_pid)
    finally:
        stop.__exit__(None, None, None)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(pending, timeout=60)

    # The producer keeps the object while the driver's ref lives, and frees it
    # once that ref is gone: the dead borrower holds nothing.
    assert ray.get(p.stats.remote()).num_objects >= 1
    del big
    t0 = time.monotonic()
    settle(store_empty(p))
    report(f"consumer_killed_during_{transport}_freed", time.monotonic() - t0)
    settle(fds_back(baseline))
    settle(shm_back(shm_before, p_pid, r_pid))
    # The producer serves others as before.
    other = Reader.remote()
    assert ray.get(other.read.remote([p.value.remote("large")], transport, 60))["ok"]
    ray.kill(other)
    ray.kill(p)


@pytest.mark.timeout(300)
def test_stream_connection_closed_during_a_tcp_read(reader):
    reason = can_kill_connections()
    if reason:
        pytest.skip(reason)
    r, r_pid = reader
    p = Producer.remote()
    p_pid = ray.get(p.pid.remote())
    port = stream_port(p)  # large tcp reads move over the stream port
    warm(p, r, "tcp")
    baseline = fd_baseline(r_pid, p_pid)

    pending, big, stop = _start_big_read(p, r, r_pid, "tcp", 7)
    try:
        t0 = time.monotonic()
        kill_connections(port)
    finally:
        stop.__exit__(None, None, None)
    result = ray.get(pending, timeout=300)
    seconds = time.monotonic() - t0
    report("stream_connection_closed_tcp", seconds)

    # Not a lost producer: the object is intact and a new read gets all of it.
    assert not result["ok"] and result["type"] == "TransferError", result
    assert "broke during the transfer" in result["message"] and "read it again" in result["message"]
    assert seconds < DETECT_BOUND_S
    again = ray.get(r.read.remote([big], "tcp", 120), timeout=300)
    assert again["ok"] and again["summary"] == [[BIG, 7]], again
    close_idle_streams(r)  # the new read's pooled connections: closed, so fds settle
    ray.get(r.drop.remote())
    del big
    settle(store_empty(p))
    # The reader may have read again on a thread whose channel cache had no channel
    # to this producer: it opens one and keeps it for the next read (a CI run saw
    # that as one more socket in each process), so each gets that much slack. The
    # agent's own sockets are fixed when it starts (a CI run saw a worker thread's
    # first reply socket here before they were).
    settle(fds_back({p_pid: baseline[p_pid]}, slack=1))
    settle(fds_back({r_pid: baseline[r_pid]}, slack=CHANNEL_FDS))
    assert check_value("dtypes", ray.get(p.value.remote("dtypes"))) is None
    ray.kill(p)
