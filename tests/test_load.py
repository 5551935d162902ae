"""Load: 8 consumers each read 100 refs from 2 producers at once, over each
transport; every value arrives exact, and afterwards the producers hold
nothing and no process keeps more fds or segments than before.

Actors are small (num_cpus=0) and shared by every transport: this machine
has 2 cores.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray import cloudpickle

import raydirect as rd
from raydirect._consumer import _FETCH_THREADS
from raydirect._stream_client import _IDLE_PER_PRODUCER

from actors import Producer, check_value
from helpers import shm_segments, wait_for

CONSUMERS = 8
REFS = 100  # per consumer, half from each producer
TRANSPORTS = ["cma", "shm", "tcp", "gloo"]
LOAD_BOUND_S = 120.0  # one transport's 800 transfers, on a loaded 2-core machine

cloudpickle.register_pickle_by_value(sys.modules[__name__])
CASE = "large"  # above the inline limit: every ref is a transfer


@ray.remote(num_cpus=0)
class Loader:
    def pid(self) -> int:
        import os

        return os.getpid()

    def read(self, refs: list[ray.ObjectRef], transport: str | None) -> list[str | None]:
        values = rd.get(refs, timeout=LOAD_BOUND_S, tensor_transport=transport)
        return [check_value(CASE, v) for v in values]

    def received(self) -> dict[str, int]:
        return rd.local_stats().objects_received


@pytest.fixture(scope="module")
def cluster(ray_session) -> Iterator[tuple[list[Any], list[Any]]]:
    producers = [Producer.remote() for _ in range(2)]
    consumers = [Loader.remote() for _ in range(CONSUMERS)]
    rd.create_collective_group([*producers, *consumers], backend="gloo", name="load")
    yield producers, consumers
    with contextlib.suppress(Exception):
        rd.destroy_collective_group("load")
    for actor in (*producers, *consumers):
        ray.kill(actor)


def _round(producers: list[Any], consumers: list[Any], transport: str, refs: int) -> float:
    method = "value_gloo" if transport == "gloo" else "value"
    batches = [
        [getattr(producers[i % 2], method).remote(CASE) for i in range(refs)] for _ in consumers
    ]
    ray.wait([r for batch in batches for r in batch], num_returns=refs * len(consumers))
    forced = None if transport == "gloo" else transport
    start = time.monotonic()
    results = ray.get(
        [c.read.remote(batch, forced) for c, batch in zip(consumers, batches, strict=True)],
        timeout=LOAD_BOUND_S,
    )
    seconds = time.monotonic() - start
    for result in results:
        assert result == [None] * refs, [p for p in result if p][:3]
    return seconds


def _fd_targets(pid: int) -> dict[str, str]:
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            out[fd] = os.readlink(f"/proc/{pid}/fd/{fd}")
    return out


# Caches that a second round may still fill even after a full warm-up round, as
# work lands on other threads: a consumer's fetch threads (and its own) each keep a
# channel per producer (a DEALER, its monitor pair and a TCP socket: 4 fds), and
# pools idle stream connections (up to _IDLE_PER_PRODUCER per producer); a
# producer's agent has up to 4 serving threads, each with one socket, and holds its
# side of each consumer's pooled stream connections. Anything beyond this is a leak
# (the soak test checks that nothing grows over time).
CHANNEL_FDS = 4
CONSUMER_HEADROOM = CHANNEL_FDS * (_FETCH_THREADS + 1) * 2 + 2 * _IDLE_PER_PRODUCER
PRODUCER_HEADROOM = 4 + CONSUMERS * _IDLE_PER_PRODUCER


def _grown(fds: dict[int, dict[str, str]], headroom: dict[int, int]) -> dict[int, Any]:
    out = {}
    for pid, before in fds.items():
        now = _fd_targets(pid)
        if len(now) > len(before) + headroom[pid]:
            out[pid] = sorted(t for fd, t in now.items() if before.get(fd) != t)
    return out


def _held(producers: list[Any]) -> int:
    return sum(ray.get(p.stats.remote()).num_objects for p in producers)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_eight_consumers_read_a_hundred_refs_each(cluster, transport):
    producers, consumers = cluster
    pids = ray.get([a.pid.remote() for a in (*producers, *consumers)])
    # A full round first: every fetch thread's channels, every agent thread, pooled
    # segments exist before the baseline.
    _round(producers, consumers, transport, REFS)
    wait_for(lambda: _held(producers) == 0, what="warm-up objects freed")
    fds = {pid: _fd_targets(pid) for pid in pids}
    owners = tuple(f"rd-{pid}-" for pid in pids)  # other tests on this machine make their own
    shm_before = {s for s in shm_segments() if s.startswith(owners)}
    before = ray.get([c.received.remote() for c in consumers])

    seconds = _round(producers, consumers, transport, REFS)
    print(f"LOAD {transport} {CONSUMERS * REFS} transfers in {seconds:.2f}s")

    after = ray.get([c.received.remote() for c in consumers])
    for b, a in zip(before, after, strict=True):  # the transport itself moved them
        assert a.get(transport, 0) - b.get(transport, 0) == REFS, (transport, b, a)
    wait_for(lambda: _held(producers) == 0, what="every object freed")
    headroom = {
        pid: PRODUCER_HEADROOM if i < 2 else CONSUMER_HEADROOM for i, pid in enumerate(pids)
    }
    wait_for(lambda: not _grown(fds, headroom), what=f"fds back: {_grown(fds, headroom)}")
    # Segments are pooled by their (living) producers for reuse, up to a cap; none
    # belongs to anyone else.
    new = {s for s in shm_segments() if s.startswith(owners)} - shm_before
    producers_own = tuple(f"rd-{pid}-" for pid in pids[:2])
    assert all(s.startswith(producers_own) for s in new), new
    if transport != "shm":
        assert not new, new
