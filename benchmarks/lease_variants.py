"""What a lease costs through Ray's two calls, and one way around it that failed.

A producer method returns a 400-byte value three ways: with no ref in it; with
a nested ``ray.put`` ref, as raydirect's lease is; and with that ref pickled
into a blob of its own, so that Ray records it as contained on the producer but
the consumer never deserializes it (and so never becomes its borrower). The
driver passes each ref to a consumer method; medians of interleaved rounds.

    ./dev python benchmarks/lease_variants.py [--rounds 300]

Measured here (docs/benchmarks.md, workload 8's notes): 2.4 ms with no ref,
3.6 ms nested, 4.4 ms as a blob: the second pickle costs more than the borrow.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import ray
from ray import cloudpickle

_VALUE = b"x" * 400


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
    def make(self, kind: str) -> Any:
        if kind == "no ref":
            return _VALUE
        lease = ray.put(b"")
        return _Nested(_VALUE, lease) if kind == "nested ref" else _Blob(_VALUE, lease)


@ray.remote
class _Consumer:
    def take(self, value: Any) -> int:
        return 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    ray.init()
    producer, consumer = _Producer.remote(), _Consumer.remote()  # type: ignore[attr-defined]
    kinds = ["no ref", "nested ref", "ref in a blob"]
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            start = time.perf_counter()
            ray.get(consumer.take.remote(producer.make.remote(kind)))
            times[kind].append(time.perf_counter() - start)
    for kind in kinds:
        print(f"{kind:>14}: {statistics.median(times[kind][20:]) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
