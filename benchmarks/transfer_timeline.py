"""Where one medium transfer spends its time, step by step, in both processes.

Workload 8's transfer (``raydirect bench --workloads 8``): the driver calls a
producer method that returns one tensor and passes the ref to a consumer
method that takes it. Inside both actors, wall-clock marks wrap raydirect's own
steps (found by name, so this is a profiling aid that follows the code, not an
API); the same two calls returning an int run alternately as the baseline. The
table gives, for each step, when it started and ended after the driver's call
and how long it took: medians over the transfers after the first.

    ./dev python benchmarks/transfer_timeline.py [--size 1MiB] [--steps 40]

Huge pages for large allocations as in ``raydirect bench`` (``THP_MEM_ALLOC_ENABLE=1``).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rdbench.common import parse_size  # noqa: E402

import raydirect as rd  # noqa: E402

# (module, attribute: a function or Class.method) of the steps marked in each role.
PRODUCER_STEPS = [
    ("raydirect._api", "export"),
    ("raydirect._producer", "split"),
    ("raydirect._producer", "_stored"),
    ("raydirect._producer", "_extract_all"),
    ("raydirect._lease", "LeasePool.take"),
    ("raydirect._payload", "Payload.__reduce__"),
    ("raydirect._payload", "InlineValue.of"),
    ("raydirect._payload", "InlineValue.__reduce__"),
]
CONSUMER_STEPS = [
    ("raydirect._payload", "_rebuild"),
    ("raydirect._payload", "_rebuild_inline"),
    ("raydirect._consumer", "choose_transport"),
    ("raydirect._consumer", "allocate_bytes"),
    ("raydirect._consumer", "_read_bytes"),
    ("raydirect.transports.cma", "CmaTransport.receive"),
    ("raydirect._channel", "notify"),
    ("raydirect._consumer", "join"),
]


class _Marks:
    """Wall-clock (start, end) of every marked step in this process."""

    def __init__(self, steps: list[tuple[str, str]]) -> None:
        self.marks: list[tuple[str, float, float]] = []
        for module_name, path in steps:
            owner: Any = importlib.import_module(module_name)
            *outer, name = path.split(".")
            for part in outer:
                owner = getattr(owner, part)
            if hasattr(owner, name):
                setattr(owner, name, self._wrapped(path, getattr(owner, name)))

    def _wrapped(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def marked(*args: Any, **kwargs: Any) -> Any:
            start = time.time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.marks.append((name, start, time.time()))

        return marked

    def mark(self, name: str) -> None:
        now = time.time()
        self.marks.append((name, now, now))


@ray.remote(num_cpus=0)
class Producer:
    def __init__(self, nbytes: int) -> None:
        self.tensor = torch.ones(nbytes // 4, dtype=torch.int32)
        self.recorder = _Marks(PRODUCER_STEPS)

    def prepare(self, seed: int) -> None:
        rd.wait_tensor_freed(self.tensor, timeout=60)
        self.tensor.fill_(seed)
        self.recorder.marks.clear()

    @rd.method
    def tensor_auto(self) -> torch.Tensor:
        self.recorder.mark("method body")
        return self.tensor

    def number(self) -> int:
        self.recorder.mark("method body")
        return int(self.tensor[0])

    def marks(self) -> list[tuple[str, float, float]]:
        return self.recorder.marks


@ray.remote(num_cpus=0)
class Consumer:
    def __init__(self) -> None:
        self.recorder = _Marks(CONSUMER_STEPS)

    def clear(self) -> None:
        self.recorder.marks.clear()

    def take(self, value: Any, seed: int) -> list[tuple[str, float, float]]:
        self.recorder.mark("method body")
        first = int(value[0]) if isinstance(value, torch.Tensor) else value
        if first != seed:
            raise ValueError(f"took {first}, expected {seed}")
        return self.recorder.marks


def run(nbytes: int, steps: int) -> None:
    producer, consumer = Producer.remote(nbytes), Consumer.remote()
    rows: dict[str, list[dict[str, tuple[float, float]]]] = {"int": [], "raydirect auto": []}
    for step in range(steps + 1):
        for system, method in (("int", producer.number), ("raydirect auto", producer.tensor_auto)):
            seed = step * 2 + (system == "int") + 1
            ray.get([producer.prepare.remote(seed), consumer.clear.remote()])
            start = time.time()
            consumer_marks = ray.get(consumer.take.remote(method.remote(), seed))
            end = time.time()
            if step == 0:  # the cold transfer: pools, channels and leases made
                continue
            row = {"the two calls": (0.0, end - start)}
            producer_marks = ray.get(producer.marks.remote())
            for role, marks in (("producer", producer_marks), ("consumer", consumer_marks)):
                for name, a, b in marks:
                    row[f"{role} {name}"] = (a - start, b - start)
            rows[system].append(row)
    for system, got in rows.items():
        print(f"\n{system}: {nbytes} bytes, {steps} transfers (ms after the driver's call)")
        print(f"{'step':40s} {'starts':>8s} {'ends':>8s} {'takes':>8s}")
        keys = sorted({k for r in got for k in r}, key=lambda k: statistics.median(
            r[k][0] for r in got if k in r))  # fmt: skip
        for key in keys:
            marks = [r[key] for r in got if key in r]
            a = statistics.median(s for s, _ in marks)
            b = statistics.median(e for _, e in marks)
            print(f"{key:40s} {a * 1e3:8.2f} {b * 1e3:8.2f} {(b - a) * 1e3:8.2f}")
    ray.kill(producer)
    ray.kill(consumer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="1MiB", help="comma-separated sizes [1MiB]")
    parser.add_argument("--steps", type=int, default=40, help="timed transfers after the cold one")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.size.split(",")]
    env = {"THP_MEM_ALLOC_ENABLE": "1", "PYTHONPATH": str(Path(__file__).resolve().parent)}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env})
    for n in sizes:
        run(n, args.steps)
    ray.shutdown()


if __name__ == "__main__":
    main()
