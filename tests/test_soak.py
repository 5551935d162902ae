"""Soak: produce/consume cycles over cma, shm and tcp in turn, sampling the
producer's and the consumer's resident memory, open fds and /dev/shm. After a
warm-up, every series must stay flat: nothing accumulates per cycle.

CI runs a reduced size; ``RAYDIRECT_SOAK_FULL=1`` runs 10,000 cycles (results
recorded in docs/guarantees.md). ``RAYDIRECT_SOAK_CYCLES`` sets any size.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import ray

from actors import Consumer, Producer
from helpers import open_fds, rss, shm_segments, wait_for

FULL = os.environ.get("RAYDIRECT_SOAK_FULL") == "1"
CYCLES = int(os.environ.get("RAYDIRECT_SOAK_CYCLES", "10000" if FULL else "900"))
SAMPLES = 10
WARM_FRACTION = 0.2  # the first cycles fill caches and pools: not part of the trend
# Flat means: after warm-up, resident memory grows by less than this (allocator
# noise; a leak of even one 1 KiB object per cycle is 10 MiB over the full soak) ...
RSS_SLACK = 24 << 20
# ... fds by no more than a cached channel or a serving thread can add, and
# /dev/shm not at all.
FD_SLACK = 4


def _sample(p_pid: int, c_pid: int) -> dict[str, Any]:
    # Only ours: other tests on this machine make segments of their own.
    segments = {s for s in shm_segments() if s.startswith((f"rd-{p_pid}-", f"rd-{c_pid}-"))}
    return {
        "producer_rss": rss(p_pid),
        "consumer_rss": rss(c_pid),
        "producer_fds": open_fds(p_pid),
        "consumer_fds": open_fds(c_pid),
        "shm": len(segments),
        "shm_bytes": sum(os.path.getsize(f"/dev/shm/{s}") for s in segments),
    }


@pytest.mark.timeout(3600 if FULL else 300)
def test_soak_stays_flat(ray_session):
    p, c = Producer.remote(), Consumer.remote()
    p_pid, c_pid = ray.get([p.pid.remote(), c.pid.remote()])
    methods = [p.value, p.value_shm, p.value_tcp]  # auto (cma here), shm, tcp
    every = max(1, CYCLES // SAMPLES)
    samples: list[dict[str, Any]] = []
    start = time.monotonic()
    for i in range(CYCLES):
        ref = methods[i % 3].remote("dtypes")
        assert ray.get(c.check.remote("dtypes", ref), timeout=60) is None
        del ref
        if (i + 1) % every == 0:
            samples.append(_sample(p_pid, c_pid))
    seconds = time.monotonic() - start
    wait_for(lambda: ray.get(p.stats.remote()).num_objects == 0, what="producer emptied")
    stats = ray.get(p.stats.remote())
    assert stats.num_bytes == 0

    warm = samples[int(SAMPLES * WARM_FRACTION)]
    last = samples[-1]
    peak = {k: max(s[k] for s in samples[int(SAMPLES * WARM_FRACTION) :]) for k in last}
    growth = {k: peak[k] - warm[k] for k in last}
    print(f"SOAK {CYCLES} cycles in {seconds:.1f}s ({1000 * seconds / CYCLES:.2f} ms/cycle)")
    print(f"SOAK after warm-up {warm}")
    print(f"SOAK last          {last}")
    print(f"SOAK peak growth   {growth}")
    mib = {k: [round(s[k] / 2**20, 1) for s in samples] for k in ("producer_rss", "consumer_rss")}
    print(f"SOAK rss series (MiB) {mib}")
    assert growth["producer_rss"] < RSS_SLACK, samples
    assert growth["consumer_rss"] < RSS_SLACK, samples
    assert growth["producer_fds"] <= FD_SLACK, samples
    assert growth["consumer_fds"] <= FD_SLACK, samples
    assert growth["shm"] == 0 and growth["shm_bytes"] == 0, samples
    ray.kill(p)
    ray.kill(c)
