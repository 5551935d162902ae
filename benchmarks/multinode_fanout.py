"""One tensor from a producer on node B to four consumers, two on node A and two on
node C (the three-node cluster of tests/multinode; needs root), with the bytes that
leave node B counted on its link.

Rows, side by side in one run: ``rd.broadcast`` (one read per node, relayed
within it), every consumer reading the producer directly over ``tcp``, Ray's
object store (which also pulls once per node), Ray's RDT over Gloo (one send
per consumer; its workers get ``GLOO_SOCKET_IFNAME=rdveth``), and weight sync:
a trainer on node B publishes a model of the same size, four inference
workers (2-way tensor parallel within each node) load half of it each.

    sudo .venv/bin/python benchmarks/multinode_fanout.py [--size 256MiB] [--repeats 3]

Each round: the producer rewrites its tensor with a new seed (untimed), then the
driver times from the producing call to all four consumers having checked what
they got (samples and a strided sum; the first, cold round element by element).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import multinode as mn

WEIGHTS = "raydirect weights (half per worker)"
ROWS = (
    "raydirect broadcast",
    WEIGHTS,
    "raydirect direct (tcp)",
    "ray object store",
    "ray RDT gloo",
)
LAYERS = 8  # the weight-sync row's model: LAYERS tensors, size / LAYERS bytes each
CONSUMER_NODES = ("nodeA", "nodeA", "nodeC", "nodeC")


def inner(size: int, repeats: int) -> dict[str, Any]:
    import ray
    import torch

    import raydirect as rd

    thp = {"THP_MEM_ALLOC_ENABLE": "1"}
    rdt_env = {"env_vars": {**thp, "GLOO_SOCKET_IFNAME": "rdveth"}}

    def fill(t: torch.Tensor, seed: int) -> None:
        torch.arange(seed, seed + t.numel(), dtype=torch.int32, out=t)

    class Source:
        def allocate(self, nbytes: int) -> None:
            self.t = torch.empty(nbytes // 4, dtype=torch.int32)

        def prepare(self, seed: int) -> None:
            fill(self.t, seed)

    @ray.remote(num_cpus=0)
    class Ours(Source):
        @rd.method(tensor_transport="auto")
        def make(self) -> Any:
            return self.t

        def prepare(self, seed: int) -> None:
            rd.wait_tensor_freed(self.t, timeout=120)
            fill(self.t, seed)

    @ray.remote(num_cpus=0)
    class Plain(Source):
        def make(self) -> Any:
            return self.t

    @ray.remote(num_cpus=0)
    class Rdt(Source):
        @ray.method(tensor_transport="gloo")
        def make(self) -> Any:
            return self.t

        def prepare(self, seed: int) -> None:
            from ray.experimental import wait_tensor_freed

            wait_tensor_freed(self.t, timeout=120)
            fill(self.t, seed)

    class Sink:
        def consume(self, t: Any, seed: int, full: bool) -> bool:
            n = t.numel()
            if full:
                return bool(torch.equal(t, torch.arange(seed, seed + n, dtype=torch.int32)))
            idx = torch.randint(0, n, (64,))
            return bool(torch.equal(t[idx].long(), idx + seed))

    @ray.remote(num_cpus=0)
    class Consumer(Sink):
        pass

    @ray.remote(num_cpus=0, enable_tensor_transport=True)  # type: ignore[call-overload]
    class RdtConsumer(Sink):
        pass

    def run(name: str, cls: Any, sink: Any, deliver: Any, env: dict, setup: Any = None) -> dict:
        producer = cls.options(resources={"nodeB": 0.001}, runtime_env=env).remote()
        consumers = [
            sink.options(resources={n: 0.001}, runtime_env=env).remote() for n in CONSUMER_NODES
        ]
        ray.get(producer.allocate.remote(size), timeout=300)
        if setup:
            setup(producer, consumers)
        times, seed = [], 0
        for i in range(repeats + 1):
            seed += 7919
            ray.get(producer.prepare.remote(seed), timeout=300)
            before = mn_link_bytes()
            t0 = time.perf_counter()
            refs = deliver(producer.make.remote(), consumers)
            ok = ray.get(
                [c.consume.remote(r, seed, i == 0) for c, r in zip(consumers, refs, strict=True)],
                timeout=600,
            )
            seconds = time.perf_counter() - t0
            egress = mn_link_bytes() - before
            del refs
            if not all(ok):
                raise ValueError(f"{name}: a consumer got wrong bytes ({ok})")
            if i:
                times.append((seconds, egress))
        for actor in [producer, *consumers]:
            ray.kill(actor)
        median = statistics.median(t for t, _ in times)
        copies = statistics.median(e for _, e in times) / size
        mn.log(f"{name}: {median:.3f} s, node B sent {copies:.2f} copies")
        return {"seconds": median, "copies_from_b": copies, "times": times}

    def mn_link_bytes() -> int:
        # The driver runs in node A's namespace: it asks the harness (its parent) via stdio.
        print("@@RD " + json.dumps({"event": "link?"}), flush=True)
        return int(sys.stdin.readline())

    thp_env = {"env_vars": thp}
    rows = {
        "raydirect broadcast": run(
            "raydirect broadcast", Ours, Consumer, lambda r, cs: rd.broadcast(r, cs), thp_env
        ),
        "raydirect direct (tcp)": run(
            "raydirect direct (tcp)", Ours, Consumer, lambda r, cs: [r] * len(cs), thp_env
        ),
        "ray object store": run(
            "ray object store", Plain, Consumer, lambda r, cs: [r] * len(cs), thp_env
        ),
    }
    from ray.experimental.collective import create_collective_group

    rows["ray RDT gloo"] = run(
        "ray RDT gloo",
        Rdt,
        RdtConsumer,
        lambda r, cs: [r] * len(cs),
        rdt_env,
        lambda p, cs: create_collective_group([p, *cs], backend="torch_gloo"),
    )
    rows[WEIGHTS] = run_weights(ray, rd, torch, size, repeats, thp_env, mn_link_bytes)
    return {"rows": rows}


def run_weights(ray: Any, rd: Any, torch: Any, size: int, repeats: int, env: dict, link: Any):
    """A trainer on node B publishes a model of ``size`` bytes; four inference
    workers (two per node, 2-way tensor parallel within it) each load half of
    every tensor's rows into their own tensors."""
    rows = size // LAYERS // 4 // 1024  # float32 rows of 1024 columns per layer

    @ray.remote(num_cpus=0)
    class Trainer:
        def __init__(self) -> None:
            self.w = {f"l{i}": torch.zeros(rows, 1024) for i in range(LAYERS)}
            self.pub = rd.WeightPublisher(self.w, depth=1)

        def step(self, version: int) -> None:  # the training step: untimed
            for w in self.w.values():
                w.fill_(version)

        def publish(self, version: int) -> Any:  # timed: the snapshot, then the loads
            return self.pub.publish(version, timeout=120)

    @ray.remote(num_cpus=0)
    class Worker:
        def __init__(self, rank: int) -> None:
            half = rows // 2
            self.w = {f"l{i}": torch.empty(half, 1024) for i in range(LAYERS)}
            span = (0, half * rank, half * (rank + 1))
            self.sub = rd.WeightSubscriber(self.w, shard=lambda name, shape: span)

        def load(self, handle: Any) -> bool:
            version = self.sub.load(handle, timeout=120)
            return all(bool((w == version).all()) for w in self.w.values())

    trainer = Trainer.options(resources={"nodeB": 0.001}, runtime_env=env).remote()
    workers = [
        Worker.options(resources={n: 0.001}, runtime_env=env).remote(i % 2)
        for i, n in enumerate(CONSUMER_NODES)
    ]
    times = []
    for version in range(1, repeats + 2):
        ray.get(trainer.step.remote(version), timeout=120)
        before = link()
        t0 = time.perf_counter()
        handle = trainer.publish.remote(version)
        ok = ray.get([w.load.remote(handle) for w in workers], timeout=600)
        seconds, egress = time.perf_counter() - t0, link() - before
        del handle
        if not all(ok):
            raise ValueError(f"weights: a worker loaded wrong values ({ok})")
        if version > 1:
            times.append((seconds, egress))
    median = statistics.median(t for t, _ in times)
    copies = statistics.median(e for _, e in times) / size
    mn.log(f"{WEIGHTS}: {median:.3f} s, node B sent {copies:.2f} copies")
    # Each worker receives half the model: two copies delivered in all.
    return {"seconds": median, "copies_from_b": copies, "times": times, "delivered": 2 * size}


def outer(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "multinode"))
    import mn_harness

    reason = mn_harness.unavailable_reason()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    size = mn.parse_size(args.size)
    cluster = mn_harness.Cluster(object_store_bytes=size * 4 + (256 << 20), workers=2)
    mn.log("starting three Ray nodes: rdA (10.77.0.1), rdB (10.77.0.2), rdC (10.77.0.3)")
    cluster.start()
    try:
        driver = cluster.start_driver(
            Path(__file__).resolve(), "--inner", "--size", args.size, "--repeats", str(args.repeats)
        )
        try:
            while True:  # answer the driver's link-counter questions until its result
                message = driver.expect(("link?", "result"), timeout=args.timeout)
                if message["event"] == "result":
                    break
                driver.send(str(mn_harness.link_bytes(mn_harness.NS_WORKER)["tx"]))
        finally:
            driver.close()
            print(driver.stderr_tail(3000), file=sys.stderr)
    finally:
        cluster.teardown()
    print(table(message["rows"], size))
    if args.json:
        Path(args.json).write_text(json.dumps(message, indent=2))
    return 0


def table(rows: dict[str, Any], size: int) -> str:
    lines = [
        f"| row ({size >> 20} MiB to 4 consumers on 2 nodes) | seconds | consumers' GB/s "
        "| vs direct | vs object store | vs RDT gloo | copies sent by node B |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in ROWS:
        r = rows[name]
        speed = [f"{rows[b]['seconds'] / r['seconds']:.2f}x" for b in ROWS[2:]]
        delivered = r.get("delivered", 4 * size)
        lines.append(
            f"| {name} | {r['seconds']:.3f} | {delivered / r['seconds'] / mn.GB:.2f} | "
            f"{' | '.join(speed)} | {r['copies_from_b']:.2f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("address", nargs="?", help=argparse.SUPPRESS)
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", default="256MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1500.0, help="whole run, seconds")
    parser.add_argument("--json", help="also write the raw timings here")
    args = parser.parse_args()
    if not args.inner:
        return outer(args)
    import ray

    ray.init(address=args.address, logging_level="warning", log_to_driver=True)
    try:
        result = inner(mn.parse_size(args.size), args.repeats)
        print("@@RD " + json.dumps({"event": "result", **result}), flush=True)
    except Exception as exc:
        print("@@RD " + json.dumps({"event": "crash", "error": repr(exc)}), flush=True)
        raise
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
