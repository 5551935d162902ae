"""Async actors read large objects off their event loop: a ticker keeps ticking."""

from __future__ import annotations

import pytest
import ray

import actors

NBYTES = 512 << 20


@pytest.fixture(scope="module")
def reader_and_producer(ray_session):
    p, r = actors.Producer.remote(), actors.AsyncReader.remote()
    yield p, r
    ray.kill(p)
    ray.kill(r)


def _read(reader, producer, how: str) -> dict:
    ref = producer.big.remote(NBYTES, 3)
    result = ray.get(reader.read_while_ticking.remote([ref], how), timeout=180)
    assert result["numel"] == NBYTES and result["first"] == 3
    return result


@pytest.mark.parametrize("how", ["get_async", "await"])
def test_the_loop_keeps_running_during_a_large_fetch(reader_and_producer, how):
    producer, reader = reader_and_producer
    result = _read(reader, producer, how)
    # A 512 MiB fetch takes tens of milliseconds at the very least; a free loop
    # ticks every 2 ms meanwhile. The blocking control below ticks not at all.
    assert result["ticks"] >= 5, result


def test_a_blocking_read_on_the_loop_stops_the_ticker(reader_and_producer):
    """The control: proves the ticker measures what the other tests claim."""
    producer, reader = reader_and_producer
    assert _read(reader, producer, "blocking")["ticks"] <= 1
