"""What a lease costs through Ray's two calls, measured in blocks.

Two questions, each run with ``--mode``:

- ``method`` (the default): a producer method returns a 400-byte value three
  ways: with no ref in it; with a nested ``ray.put`` ref, as raydirect's lease
  is; and with that ref pickled into a blob of its own, so that Ray records it
  as contained on the producer but the consumer never deserializes it (and so
  never becomes its borrower). The driver passes each ref to a consumer method.
- ``transfer``: what issue 41's targets are stated against: the producer's
  method returns ``--size`` bytes (1 MiB), the consumer takes the value as a
  task argument. Three kinds: the two bare calls (a 400-byte value, no
  raydirect); ``@rd.method`` (its lease); ``@rd.method(reads=1)`` (no lease).
- ``put``: the producer ``rd.put``s 1 MiB and returns the ref in a list; the
  consumer ``ray.get``s it. Three kinds: ``ray.put`` of an int (the calls and a
  put ref, no raydirect); ``rd.put`` as it is (no lease: the callback sits on
  the put ref); and the same Payload with a lease, as ``rd.put`` was before
  (``ray.put(export(...))``: ``export`` takes a lease for a method's return).

Each kind runs in blocks of ``--block`` consecutive transfers (the first 5 of
each block not counted), kinds rotating, ``--blocks`` blocks each: alternating
call by call would charge one kind's background work (lease release, plasma
eviction, pubsub) to the next. Printed: the median latency, and the CPU per
transfer of the driver, producer, consumer, raylet and GCS together.

    ./dev python benchmarks/lease_variants.py [--mode method|put|transfer] [--blocks 8]

Measured here: docs/benchmarks.md (workload 8's notes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import ray
import torch
from ray import cloudpickle

import raydirect as rd
from raydirect import _producer

_VALUE = b"x" * 400
_WARM = 5


class _Nested:
    def __init__(self, data: bytes, lease: Any) -> None:
        self.data, self.lease = data, lease


def _from_blob(data: bytes, blob: bytes) -> _Blob:
    return _Blob(data, None, blob)


class _Blob:
    def __init__(self, data: bytes, lease: Any, blob: bytes | None = None) -> None:
        self.data, self.lease, self.blob = data, lease, blob

    def __reduce__(self) -> Any:
        # Under Ray's serializer the inner pickle still records the ref as contained.
        blob = self.blob if self.blob is not None else cloudpickle.dumps(self.lease)
        return _from_blob, (self.data, blob)


@ray.remote
class _Producer:
    def __init__(self) -> None:
        self.tensor = torch.ones(1 << 18, dtype=torch.float32)  # 1 MiB

    def pid(self) -> int:
        return os.getpid()

    def make(self, kind: str) -> Any:
        if kind == "no ref":
            return _VALUE
        lease = ray.put(b"")
        return _Nested(_VALUE, lease) if kind == "nested ref" else _Blob(_VALUE, lease)

    def resize(self, nbytes: int) -> None:
        self.tensor = torch.ones(nbytes // 4, dtype=torch.float32)

    @rd.method
    def leased(self) -> torch.Tensor:
        return self.tensor

    @rd.method(reads=1)
    def read_once(self) -> torch.Tensor:
        return self.tensor

    def put(self, kind: str) -> list[ray.ObjectRef]:
        if kind == "ray.put of an int":
            return [ray.put(1)]
        if kind == "rd.put with a lease (before)":
            return [ray.put(_producer.export(self.tensor, "auto"))]
        return [rd.put(self.tensor)]

    def held(self) -> int:
        return rd.local_stats().num_objects


@ray.remote
class _Consumer:
    def pid(self) -> int:
        return os.getpid()

    def take(self, value: Any) -> int:
        return int(value.numel()) if isinstance(value, torch.Tensor) else 1

    def take_put(self, refs: list[ray.ObjectRef]) -> int:
        value = ray.get(refs[0])
        return 1 if isinstance(value, int) else int(value.numel())


def _cpu_seconds(pids: list[int]) -> float:
    ticks = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime + stime
    return ticks / os.sysconf("SC_CLK_TCK")


def _ray_pids() -> list[int]:
    pids = []
    for name in ("raylet", "gcs_server"):
        found = subprocess.run(["pgrep", "-n", name], capture_output=True, text=True).stdout
        pids += [int(p) for p in found.split()]
    return pids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("method", "put", "transfer"), default="method")
    parser.add_argument("--size", type=int, default=1 << 20, help="--mode transfer: bytes")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--block", type=int, default=25)
    args = parser.parse_args()
    ray.init(include_dashboard=False)
    producer, consumer = _Producer.remote(), _Consumer.remote()  # type: ignore[attr-defined]
    pids = [os.getpid(), *ray.get([producer.pid.remote(), consumer.pid.remote()]), *_ray_pids()]
    ops: dict[str, Callable[[], Any]]
    if args.mode == "method":
        kinds = ["no ref", "nested ref", "ref in a blob"]
        ops = {k: (lambda k=k: consumer.take.remote(producer.make.remote(k))) for k in kinds}
    elif args.mode == "transfer":
        ray.get(producer.resize.remote(args.size))
        calls = {
            "bare calls": lambda: producer.make.remote("no ref"),
            "rd.method (lease)": producer.leased.remote,
            "rd.method(reads=1)": producer.read_once.remote,
        }
        kinds = list(calls)
        ops = {k: (lambda k=k: consumer.take.remote(calls[k]())) for k in kinds}
    else:
        kinds = ["ray.put of an int", "rd.put with a lease (before)", "rd.put (no lease)"]
        ops = {k: (lambda k=k: consumer.take_put.remote(producer.put.remote(k))) for k in kinds}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.blocks):
        for kind in kinds:
            for _ in range(_WARM):
                ray.get(ops[kind]())
            used = _cpu_seconds(pids)
            for _ in range(args.block):
                start = time.perf_counter()
                ray.get(ops[kind]())
                times[kind].append(time.perf_counter() - start)
            cpu[kind].append((_cpu_seconds(pids) - used) / args.block)
    for kind in kinds:
        print(
            f"{kind:>30}: {statistics.median(times[kind]) * 1e3:.2f} ms, "
            f"CPU {statistics.median(cpu[kind]) * 1e3:.2f} ms per transfer"
        )
    if args.mode == "transfer":
        base = statistics.median(times["bare calls"])
        for kind in kinds[1:]:
            print(f"{kind:>30}: {statistics.median(times[kind]) / base:.2f}x the bare calls")
    if args.mode in ("put", "transfer"):
        print(f"objects left in the producer: {ray.get(producer.held.remote())}")


if __name__ == "__main__":
    main()
