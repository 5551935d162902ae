"""``raydirect demo``: the main job, on an embedded local Ray.

A producer actor hands tensors to a consumer actor over every transport
available here and over Ray's object store, checks every transfer's contents,
and prints what it measured.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from typing import Any

import ray
import torch

import raydirect as rd
from raydirect import _ray
from raydirect.transports.shm import sweep_after_shutdown

MiB = 1 << 20
SIZES = (1 * MiB, 64 * MiB, 256 * MiB)
QUICK_SIZES = (1 * MiB, 16 * MiB)
REPEATS = 3
TRANSPORTS = ("auto", "cma", "shm", "tcp")
OBJECT_STORE = "ray object store"
_MARK_STRIDE = 4099  # a prime, so marks land on every byte offset of a page


class _ProducerBase:
    """Keeps one buffer per size; each call stamps fresh marks so a stale read shows."""

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}

    def _stamp(self, nbytes: int, mark: int) -> torch.Tensor:
        buf = self.buffers.get(nbytes)
        if buf is None:
            buf = self.buffers[nbytes] = torch.zeros(nbytes, dtype=torch.uint8)
        buf[::_MARK_STRIDE] = mark
        return buf

    def plain(self, nbytes: int, mark: int) -> torch.Tensor:
        return self._stamp(nbytes, mark)


def _decorated(transport: str):
    def method(self, nbytes: int, mark: int) -> torch.Tensor:
        return self._stamp(nbytes, mark)

    method.__name__ = f"over_{transport}"
    return rd.method(tensor_transport=transport)(method)


Producer: Any = ray.remote(num_cpus=0)(
    type("DemoProducer", (_ProducerBase,), {f"over_{t}": _decorated(t) for t in TRANSPORTS})
)


class _Consumer:
    def check(self, tensor: torch.Tensor, mark: int) -> int:
        marks = tensor[::_MARK_STRIDE]
        if not bool((marks == mark).all()) or int(tensor[1]) != 0:
            raise AssertionError("the consumer received wrong bytes")
        return tensor.numel()


Consumer: Any = ray.remote(num_cpus=0)(_Consumer)


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _measure(producer: Any, consumer: Any, system: str, nbytes: int, repeats: int) -> list[float]:
    call = producer.plain if system == OBJECT_STORE else getattr(producer, f"over_{system}")
    rates = []
    for i in range(repeats + 1):  # the first is a warm-up
        mark = 1 + (i % 250)
        start = time.perf_counter()
        got = ray.get(consumer.check.remote(call.remote(nbytes, mark), mark))
        elapsed = time.perf_counter() - start
        assert got == nbytes
        if i:
            rates.append(nbytes / elapsed / 1e9)
    return rates


def run_demo(quick: bool = False) -> int:
    sizes = QUICK_SIZES if quick else SIZES
    _progress("raydirect demo: starting an embedded Ray ...")
    ray.init(
        include_dashboard=False,
        logging_level=logging.ERROR,
        log_to_driver=False,
        runtime_env={"env_vars": {"THP_MEM_ALLOC_ENABLE": "1"}},
    )
    try:
        producer, consumer = Producer.remote(), Consumer.remote()
        ray.get([producer.plain.remote(1, 1), consumer.check.remote(torch.zeros(2), 0)])
        rows = []
        for nbytes in sizes:
            medians: dict[str, float] = {}
            for system in (*TRANSPORTS, OBJECT_STORE):
                _progress(f"  {nbytes // MiB:>4} MiB over {system} ...")
                rates = _measure(producer, consumer, system, nbytes, REPEATS)
                medians[system] = statistics.median(rates)
            base = medians[OBJECT_STORE]
            for system, rate in medians.items():
                rows.append((nbytes, system, rate, rate / base))
        print()
        print(
            "actor -> actor, end to end, every transfer's contents checked "
            f"(median of {REPEATS}; {torch.get_num_threads()} torch threads in the driver)"
        )
        print(f"{'size':>8}  {'system':<18} {'GB/s':>7}  {'vs object store':>15}")
        for nbytes, system, rate, ratio in rows:
            print(f"{nbytes // MiB:>4} MiB  {system:<18} {rate:>7.2f}  {ratio:>14.1f}x")
        stats = ray.get(_ray.run_in_actor(producer, lambda self: rd.local_stats()))
        print(
            f"\nproducer served {sum(stats.objects_sent.values())} objects directly "
            f"({', '.join(f'{k}: {v}' for k, v in sorted(stats.objects_sent.items()))}); "
            f"it still holds {stats.num_objects}."
        )
        print(
            "\nNext: decorate your own producer method with @rd.method and pass the ref on"
            " (examples/quickstart.py); trainer -> rollouts weight sync with rd.broadcast and"
            " into=: examples/weight_sync.py; the full comparison with Ray's RDT:"
            " `raydirect bench`."
        )
        return 0
    finally:
        ray.shutdown()
        sweep_after_shutdown()
