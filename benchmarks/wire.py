"""What does encrypting the ``tcp`` stream path cost, and is clear ``tcp`` as fast as before?

One question, one machine: an actor on this node reads one int32 tensor from
producers that differ only in their wire (clear; encrypted with AES-GCM frames,
the default; encrypted in TLS records in user space), over ``tcp``. Rounds
interleave the producers (one read from each per round, in a rotating order), so
a burst of load from elsewhere on a shared machine hits every row alike; the
ratios come from medians over the rounds. Every read is checked (size, samples).

Run it inside a network namespace with only ``lo`` (``ip netns add x; ip -n x
link set lo up; ip netns exec x ...``): Ray's node address is then 127.0.0.1 and
nothing leaves loopback. Run it with ``PYTHONPATH=<another checkout>/src`` to
measure that code's clear row (rows its raydirect cannot make are skipped)::

    python benchmarks/wire.py --sizes 16MiB,128MiB,512MiB --rounds 9 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import ray
import torch

import raydirect as rd

MIB = 1 << 20
WIRES = {  # row -> the producer's environment
    "tcp (clear)": {"RAYDIRECT_ENCRYPT": "0"},
    "tcp (encrypted, TLS, frames)": {"RAYDIRECT_ENCRYPT": "1", "RAYDIRECT_TLS_RECORDS": "frames"},
    "tcp (encrypted, TLS records in user space)": {
        "RAYDIRECT_ENCRYPT": "1",
        "RAYDIRECT_TLS_RECORDS": "tls",
    },
}


@ray.remote(num_cpus=0)
class Producer:
    def __init__(self) -> None:
        self.tensors: dict[int, torch.Tensor] = {}

    def allocate(self, nbytes: int) -> None:
        self.tensors[nbytes] = torch.arange(nbytes // 4, dtype=torch.int32)

    @rd.method(tensor_transport="tcp")
    def make(self, nbytes: int) -> torch.Tensor:
        return self.tensors[nbytes]

    def encryption(self) -> str:
        return str(getattr(rd.local_stats(), "encryption", "none (before issue 26)"))


@ray.remote(num_cpus=0)
class Consumer:
    def read(self, refs: list[Any], nbytes: int) -> float:
        start = time.perf_counter()
        got = rd.get(refs[0], timeout=300, tensor_transport="tcp")
        seconds = time.perf_counter() - start
        n = nbytes // 4
        if got.numel() != n or int(got[n // 2]) != n // 2 or int(got[-1]) != n - 1:
            raise AssertionError("a read arrived wrong")
        return seconds


def parse_size(text: str) -> int:
    return int(text.lower().removesuffix("mib")) * MIB


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sizes", default="16MiB,128MiB,512MiB")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", help="write the timings here")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    ray.init(num_cpus=4, include_dashboard=False, logging_level="warning")
    consumer = Consumer.remote()
    producers = {}
    for name, env in WIRES.items():
        p = Producer.options(
            runtime_env={"env_vars": {"THP_MEM_ALLOC_ENABLE": "1", **env}}
        ).remote()
        try:
            ray.get([p.allocate.remote(n) for n in [MIB, *sizes]])
            ray.get(consumer.read.remote([p.make.remote(MIB)], MIB))  # warm: agent, connections
            producers[name] = p
            print(f"{name}: producer's encryption {ray.get(p.encryption.remote())}", flush=True)
        except Exception as exc:  # an older raydirect cannot make this row
            print(f"{name}: skipped ({type(exc).__name__}: {str(exc)[:200]})", flush=True)
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in sizes} for name in producers}
    names = list(producers)
    for nbytes in sizes:
        for name in names:  # one cold read each
            ray.get(consumer.read.remote([producers[name].make.remote(nbytes)], nbytes))
        for round_ in range(args.rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in order:
                ref = producers[name].make.remote(nbytes)
                ray.wait([ref])
                times[name][nbytes].append(ray.get(consumer.read.remote([ref], nbytes)))
    print(
        "\n| size | "
        + " | ".join(names)
        + " | "
        + " | ".join(f"{n} vs clear" for n in names[1:])
        + " |"
    )
    print("|---|" + "---:|" * (2 * len(names) - 1))
    result: dict[str, Any] = {"rounds": args.rounds, "load": os.getloadavg(), "rows": {}}
    for nbytes in sizes:
        rates = {n: nbytes / statistics.median(times[n][nbytes]) / 1e9 for n in names}
        clear = rates[names[0]]
        cells = [f"{rates[n]:.2f}" for n in names] + [f"{rates[n] / clear:.2f}x" for n in names[1:]]
        print(f"| {nbytes // MIB} MiB | " + " | ".join(cells) + " |")
        result["rows"][nbytes] = {n: {"gbps": rates[n], "times_s": times[n][nbytes]} for n in names}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    ray.shutdown()


if __name__ == "__main__":
    main()
