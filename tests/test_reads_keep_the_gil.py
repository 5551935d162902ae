"""A same-node read of at most 16 MiB keeps the GIL from start to end (``transports.cma``,
``_process.process_alive``, ``_region_rows``).

A reader often shares its process with a thread that runs Python all the time:
a vLLM worker's loop beside the KV connector's reads, an actor's event loop.
Each call that lets the GIL go must then wait up to the switch interval (5 ms by
default) to have it back: an 8 MiB read beside such a thread took 6.6-10.7 ms,
and takes its 0.3 ms when it never lets go. Here the busy thread counts, and the
switch interval is long: any call in the read that let the GIL go would hand it
to the counter, and the count would move.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import pytest
import ray
import region_actors
import torch
from ray import cloudpickle
from region_actors import BLOCK_BYTES, BLOCKS, LAYERS, Owner, expected, kv_rows

import raydirect as rd

cloudpickle.register_pickle_by_value(region_actors)

READS = 20


@pytest.fixture
def owner(ray_session):
    o = Owner.remote()
    yield o
    ray.kill(o)


def _moves_during(read: Callable[[], object]) -> list[int]:
    """How far a thread counting in Python got during each of ``READS`` calls of
    ``read``, with a switch interval of half a second: 0 where ``read`` never let
    the GIL go."""
    count, stop = [0], threading.Event()

    def busy() -> None:
        while not stop.is_set():
            count[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.5)
    counter = threading.Thread(target=busy, daemon=True)
    try:
        counter.start()
        moved = []
        for _ in range(READS):
            before = count[0]
            read()
            moved.append(count[0] - before)
        return moved
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        counter.join(30)


@pytest.mark.parametrize("order", ["in order", "out of order"])
def test_a_region_read_never_lets_the_gil_go(owner, order):
    handle = ray.get(owner.handle.remote())
    blocks = list(range(8)) if order == "in order" else [5, 1, 7, 0, 3, 2, 6, 4]
    rows = kv_rows(blocks, list(range(8)))
    dests = [torch.zeros(BLOCKS * BLOCK_BYTES // 4) for _ in range(LAYERS)]
    rd.read_ranges(handle, rows, into=dests, timeout=30)  # connects, caches the handle
    moved = _moves_during(lambda: rd.read_ranges(handle, rows, into=dests, timeout=30))
    # A read that let go once shows a move of millions (before, most reads did).
    # Allowed: a switch forced after half a second of holding, and a rare wait
    # on a lock another thread of the process holds (the read notices').
    assert sorted(moved)[-3] == 0, moved
    for got, want in zip(dests, expected(blocks, list(range(8))), strict=True):
        assert torch.equal(got.view(BLOCKS, -1)[:8], want.view(BLOCKS, -1)[:8])
