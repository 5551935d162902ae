"""The drivers of workloads 15 and 16, inside the head's namespace of the
multi-node harness (``rdbench.multinode`` starts the cluster and this script):

    python cross_node.py ADDRESS two-nodes|fan-out SIZES REPEATS

Joins the cluster, runs the scenario and reports its timings as one JSON message
(``tests/multinode/mn_driver.run``: the result, or the crash). The actor classes
live here (``__main__``), so Ray ships them to every node by value; what they
call of ``rdbench`` the workers import, from the folder put on their
``PYTHONPATH``.

Every transfer: the producer rewrites its preallocated tensor with a new seed
(untimed), then the driver times from the producing call until every consumer
has checked what it got (``rdbench.common.check_pattern``: samples and a strided
sum). Rows interleave: one transfer of each per round, in a rotating order, so
a burst of load from elsewhere hits every row alike.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCHMARKS), str(BENCHMARKS.parent / "tests" / "multinode")]

import mn_driver  # noqa: E402  (tests/multinode: join, wait for the nodes, result or crash)
import ray  # noqa: E402
import torch  # noqa: E402
from ray.experimental import wait_tensor_freed as rdt_wait_tensor_freed  # noqa: E402
from ray.experimental.collective import create_collective_group  # noqa: E402

import raydirect as rd  # noqa: E402
from rdbench.common import (  # noqa: E402
    DTYPE,
    ELEMENT_BYTES,
    SEED_STEP,
    THP_ENV,
    check_pattern,
    fill_pattern,
)

TIMEOUT_S = 300.0
ON_A, ON_B, ON_C = ({"resources": {n: 0.001}} for n in ("nodeA", "nodeB", "nodeC"))
WORKER_PATH = os.pathsep.join(p for p in (str(BENCHMARKS), os.environ.get("PYTHONPATH")) if p)
ENV = {**THP_ENV, "PYTHONPATH": WORKER_PATH}  # huge pages for every worker, every row
# Ray's RDT finds no interface across these nodes by itself; raydirect must not need it.
RDT_ENV = {**ENV, "GLOO_SOCKET_IFNAME": "rdveth"}
CONSUMER_NODES = (ON_A, ON_A, ON_C, ON_C)  # workload 16: two consumers on each other node
LAYERS = 8  # workload 16's weight-sync row: a model of LAYERS tensors


def env(extra: dict[str, str] | None = None, base: dict[str, str] = ENV) -> dict[str, Any]:
    return {"runtime_env": {"env_vars": {**base, **(extra or {})}}}


class Source:
    """A preallocated int32 tensor, rewritten with a new seed before each transfer."""

    t: torch.Tensor

    def allocate(self, nbytes: int) -> str:
        self.t = torch.empty(nbytes // ELEMENT_BYTES, dtype=DTYPE)
        fill_pattern(self.t, 0)  # every page touched before any timing
        return str(ray.util.get_node_ip_address())

    def wait_free(self) -> None:
        """Ray's object store copies at return: nothing to wait for."""

    def prepare(self, seed: int) -> None:
        self.wait_free()
        fill_pattern(self.t, seed)


@ray.remote(num_cpus=0)
class Ours(Source):
    def wait_free(self) -> None:
        rd.wait_tensor_freed(self.t, timeout=TIMEOUT_S)

    @rd.method(tensor_transport="tcp")
    def make_tcp(self) -> torch.Tensor:
        return self.t

    @rd.method(tensor_transport="gloo")
    def make_gloo(self) -> torch.Tensor:
        return self.t

    @rd.method
    def make(self) -> torch.Tensor:
        return self.t


@ray.remote(num_cpus=0)
class Plain(Source):
    def make(self) -> torch.Tensor:
        return self.t


@ray.remote(num_cpus=0)
class Rdt(Source):
    def wait_free(self) -> None:
        rdt_wait_tensor_freed(self.t, timeout=TIMEOUT_S)

    @ray.method(tensor_transport="gloo")  # type: ignore[call-arg]
    def make(self) -> torch.Tensor:
        return self.t


class Sink:
    def consume(self, t: Any, seed: int, nbytes: int) -> int:
        check_pattern(t, seed, nbytes)
        return nbytes

    def where(self) -> str:
        return str(ray.util.get_node_ip_address())

    def stats(self) -> dict[str, int]:
        return dict(rd.local_stats().objects_received)


@ray.remote(num_cpus=0)
class Consumer(Sink):
    pass


# RDT receives on a concurrency group Ray adds only with enable_tensor_transport=True.
@ray.remote(num_cpus=0, enable_tensor_transport=True)  # type: ignore[call-overload]
class RdtConsumer(Sink):
    pass


# A row: its name, the producer, how it makes a ref, and how the ref reaches the
# consumers (the refs each one gets).
System = tuple[str, Any, Callable[[], Any], list[Any], Callable[[Any, list[Any]], list[Any]]]


def direct(ref: Any, consumers: list[Any]) -> list[Any]:
    return [ref] * len(consumers)


def link_bytes() -> int:
    """Bytes node B has sent on its link: the harness (this driver's parent) reads
    the counter, since this process runs in node A's namespace."""
    print(mn_driver.MESSAGE_PREFIX + json.dumps({"event": "link?"}), flush=True)
    return int(sys.stdin.readline())


def rounds(systems: list[System], nbytes: int, repeats: int, seed: int) -> list[dict[str, Any]]:
    """Each system at ``nbytes``: one cold transfer, then ``repeats`` rounds, one
    transfer of each per round in a rotating order. A system that fails leaves."""
    results = [{"system": s[0], "nbytes": nbytes, "times_s": [], "sent": []} for s in systems]
    live = []
    for system, result in zip(systems, results, strict=True):
        try:
            ray.get(system[1].allocate.remote(nbytes), timeout=TIMEOUT_S)
            live.append((system, result))
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
    for i in range(repeats + 1):
        for k in range(len(live)):
            (name, producer, make, consumers, deliver), result = live[(k + i) % len(live)]
            if "error" in result:
                continue
            seed += SEED_STEP
            try:
                ray.get(producer.prepare.remote(seed), timeout=TIMEOUT_S)
                before = link_bytes()
                start = time.perf_counter()
                refs = deliver(make(), consumers)
                calls = [
                    c.consume.remote(r, seed, nbytes) for c, r in zip(consumers, refs, strict=True)
                ]
                ray.get(calls, timeout=TIMEOUT_S)
                seconds, sent = time.perf_counter() - start, link_bytes() - before
                # The refs held here would keep the producer's next prepare waiting
                # for its tensor's free (rd.wait_tensor_freed) until it timed out.
                del refs, calls
            except Exception as exc:
                result["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
                continue
            if i:
                result["times_s"].append(seconds)
                result["sent"].append(sent)
            else:
                result["cold_s"] = seconds
    return results


def two_nodes(sizes: list[int], repeats: int) -> dict[str, Any]:
    """Workload 15: one tensor from an actor on node B to one on node A, over
    raydirect tcp (one stream, then its default streams, clear and encrypted
    two ways), raydirect gloo, Ray's object store and Ray's RDT over gloo."""
    producer = Ours.options(**ON_B, **env()).remote()
    consumer = Consumer.options(**ON_A, **env()).remote()
    nodes = ray.get([producer.allocate.remote(1 << 20), consumer.where.remote()], timeout=TIMEOUT_S)
    rd.create_collective_group([producer, consumer], backend="gloo", name="bench")
    one_stream = Consumer.options(**ON_A, **env({"RAYDIRECT_TCP_STREAMS": "1"})).remote()
    sealed = {
        records: Ours.options(
            **ON_B, **env({"RAYDIRECT_ENCRYPT": "1", "RAYDIRECT_TLS_RECORDS": records})
        ).remote()
        for records in ("frames", "tls")
    }
    plain, plain_sink = (
        Plain.options(**ON_B, **env()).remote(),
        Consumer.options(**ON_A, **env()).remote(),
    )
    rdt = Rdt.options(**ON_B, **env(base=RDT_ENV)).remote()
    rdt_sink = RdtConsumer.options(**ON_A, **env(base=RDT_ENV)).remote()
    ray.get([rdt.allocate.remote(1 << 20), rdt_sink.where.remote()], timeout=TIMEOUT_S)
    create_collective_group([rdt, rdt_sink], backend="torch_gloo")
    systems: list[System] = [
        ("raydirect tcp (1 stream)", producer, producer.make_tcp.remote, [one_stream], direct),
        ("raydirect tcp", producer, producer.make_tcp.remote, [consumer], direct),
        *(
            (name, sealed[records], sealed[records].make_tcp.remote, [consumer], direct)
            for records, name in (
                ("frames", "raydirect tcp (encrypted, TLS)"),
                ("tls", "raydirect tcp (encrypted, TLS records in user space)"),
            )
        ),
        ("raydirect gloo", producer, producer.make_gloo.remote, [consumer], direct),
        ("ray object store", plain, plain.make.remote, [plain_sink], direct),
        ("ray RDT gloo", rdt, rdt.make.remote, [rdt_sink], direct),
    ]  # fmt: skip
    rows = []
    for k, nbytes in enumerate(sizes):
        rows += rounds(systems, nbytes, repeats, seed=k << 24)
    received = ray.get(consumer.stats.remote(), timeout=TIMEOUT_S)
    return {"rows": rows, "nodes": nodes, "received": received}


def fan_out(sizes: list[int], repeats: int) -> dict[str, Any]:
    """Workload 16: one tensor from node B to four consumers, two on node A and
    two on node C, with the bytes node B sends counted on its link."""
    rows = []
    for nbytes in sizes:
        systems: list[System] = []
        for name, cls, sink, deliver, base in (
            ("raydirect broadcast", Ours, Consumer, rd.broadcast, ENV),
            ("raydirect direct (tcp)", Ours, Consumer, direct, ENV),
            ("ray object store", Plain, Consumer, direct, ENV),
            ("ray RDT gloo", Rdt, RdtConsumer, direct, RDT_ENV),
        ):
            producer = cls.options(**ON_B, **env(base=base)).remote()
            consumers = [sink.options(**n, **env(base=base)).remote() for n in CONSUMER_NODES]
            if cls is Rdt:
                create_collective_group([producer, *consumers], backend="torch_gloo")
            make = producer.make_tcp.remote if name.endswith("(tcp)") else producer.make.remote
            systems.append((name, producer, make, consumers, deliver))
        rows += rounds(systems, nbytes, repeats, seed=nbytes)
        rows.append(weights(nbytes, repeats))
        for _, producer, _, consumers, _ in systems:
            for actor in (producer, *consumers):
                ray.kill(actor)
    return {"rows": rows}


@ray.remote(num_cpus=0)
class Trainer:
    def __init__(self, rows: int) -> None:
        self.w = {f"l{i}": torch.zeros(rows, 1024) for i in range(LAYERS)}
        self.pub = rd.WeightPublisher(self.w, depth=1)

    def step(self, version: int) -> None:  # the training step: untimed
        for w in self.w.values():
            w.fill_(version)

    def publish(self, version: int) -> Any:  # timed: the snapshot, then the loads
        return self.pub.publish(version, timeout=TIMEOUT_S)


@ray.remote(num_cpus=0)
class Worker:
    """One of two tensor-parallel ranks on its node: half of every tensor's rows."""

    def __init__(self, rows: int, rank: int) -> None:
        half = rows // 2
        self.w = {f"l{i}": torch.empty(half, 1024) for i in range(LAYERS)}
        span = (0, half * rank, half * (rank + 1))
        self.sub = rd.WeightSubscriber(self.w, shard=lambda name, shape: span)

    def load(self, handle: Any) -> bool:
        version = self.sub.load(handle, timeout=TIMEOUT_S)
        return all(bool((w == version).all()) for w in self.w.values())


def weights(nbytes: int, repeats: int) -> dict[str, Any]:
    """A trainer on node B publishes a model of ``nbytes``; the four workers load
    half of it each (two copies delivered in all)."""
    rows = nbytes // LAYERS // 4 // 1024  # float32 rows of 1024 columns per tensor
    trainer = Trainer.options(**ON_B, **env()).remote(rows)
    workers = [
        Worker.options(**n, **env()).remote(rows, i % 2) for i, n in enumerate(CONSUMER_NODES)
    ]
    result: dict[str, Any] = {"system": "raydirect weights (half per worker)", "nbytes": nbytes,
                              "delivered": 2 * nbytes, "times_s": [], "sent": []}  # fmt: skip
    for version in range(1, repeats + 2):
        ray.get(trainer.step.remote(version), timeout=TIMEOUT_S)
        before, start = link_bytes(), time.perf_counter()
        handle = trainer.publish.remote(version)
        ok = ray.get([w.load.remote(handle) for w in workers], timeout=TIMEOUT_S)
        seconds, sent = time.perf_counter() - start, link_bytes() - before
        del handle
        if not all(ok):
            result["error"] = f"a worker loaded wrong values ({ok})"
            break
        if version > 1:
            result["times_s"].append(seconds)
            result["sent"].append(sent)
        else:
            result["cold_s"] = seconds
    for actor in (trainer, *workers):
        ray.kill(actor)
    return result


SCENARIOS = {
    "two-nodes": (two_nodes, ("nodeA", "nodeB")),
    "fan-out": (fan_out, ("nodeA", "nodeB", "nodeC")),
}


def main() -> None:
    address, scenario, sizes, repeats = sys.argv[1:5]
    run, nodes = SCENARIOS[scenario]
    chosen = [int(s) for s in sizes.split(",")]
    mn_driver.run(address, nodes, lambda: run(chosen, int(repeats)))


if __name__ == "__main__":
    main()
