"""Fan-out scenarios on the three-node cluster; run inside the head's namespace.

    python mn_fanout_driver.py ADDRESS SCENARIO

A producer on node B, four consumers: two on node A, two on node C. The test
reads each node's link counters between the driver's messages (``ready``, then
``go <mode>`` / ``done`` per mode), so the driver does nothing between them.
Actor classes come from ``mn_driver`` (shipped to workers by value).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import mn_driver
import ray
import torch
from mn_driver import GET_TIMEOUT_S, Consumer, Producer, delta, describe, on, send
from ray import cloudpickle

import raydirect as rd

cloudpickle.register_pickle_by_value(mn_driver)

CONSUMER_NODES = ("nodeA", "nodeA", "nodeC", "nodeC")
LOSS_ROUNDS = 50


@ray.remote(num_cpus=0)
class Trainer:
    """Publishes a 64 MiB "model" of 8 tensors, a new version per call."""

    def __init__(self) -> None:
        self.weights = {f"layer{i}.weight": torch.zeros(1024, 2048) for i in range(8)}
        self.publisher = rd.WeightPublisher(self.weights, depth=1)

    def publish(self, version: int) -> Any:
        for i, w in enumerate(self.weights.values()):
            w.copy_(weight_value(version, i))
        return self.publisher.publish(version, timeout=GET_TIMEOUT_S)


@ray.remote(num_cpus=0)
class Inference:
    """Holds half of every weight's rows (2-way tensor parallel within its node)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.weights = {f"layer{i}.weight": torch.empty(512, 2048) for i in range(8)}
        rows = (512 * rank, 512 * (rank + 1))
        self.subscriber = rd.WeightSubscriber(self.weights, shard=lambda name, shape: (0, *rows))

    def load(self, handle: Any) -> dict[str, Any]:
        version = self.subscriber.load(handle, timeout=GET_TIMEOUT_S)
        rows = slice(512 * self.rank, 512 * (self.rank + 1))
        bad = [
            name
            for i, (name, w) in enumerate(self.weights.items())
            if not torch.equal(w, weight_value(version, i)[rows])
        ]
        return {"version": version, "wrong": bad}


def weight_value(version: int, index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(version * 100 + index)
    return torch.randn(1024, 2048, generator=g)


def consumers() -> list[Any]:
    return [Consumer.options(**on(node)).remote() for node in CONSUMER_NODES]


def stats_of(actors: list[Any]) -> list[dict[str, int]]:
    return ray.get([a.stats.remote() for a in actors], timeout=GET_TIMEOUT_S)


def fan_out(producer: Any, readers: list[Any], mode: str) -> dict[str, Any]:
    before = stats_of(readers)
    ref = producer.make_auto.remote("pattern")
    refs = rd.broadcast(ref, readers, timeout=GET_TIMEOUT_S) if mode == "broadcast" else [ref] * 4
    bad = ray.get(
        [r.check.remote(x, "pattern") for r, x in zip(readers, refs, strict=True)], timeout=300
    )
    received = [delta(a, b) for a, b in zip(stats_of(readers), before, strict=True)]
    return {"mismatches": bad, "received": received}


def expect_go() -> str:
    line = sys.stdin.readline().strip()
    if not line.startswith("go"):
        raise RuntimeError(f"the test said {line!r}, not go")
    return line.partition(" ")[2]


def scenario_fan_out(address: str) -> dict[str, Any]:
    """Broadcast, direct reads and sharded weight loads, each in one measured window."""
    producer = Producer.options(**on("nodeB")).remote()
    readers = consumers()
    trainer = Trainer.options(**on("nodeB")).remote()
    workers = [Inference.options(**on(n)).remote(i % 2) for i, n in enumerate(CONSUMER_NODES)]
    # Warm up every path (agents, connections, relays, a first version) out of the windows.
    fan_out(producer, readers, "broadcast")
    first = trainer.publish.remote(1)
    ray.get([w.load.remote(first) for w in workers], timeout=300)
    del first  # a handle alive here would hold the publisher's one slot
    ips = {
        "producer": ray.get(producer.info.remote(), timeout=GET_TIMEOUT_S)["ip"],
        "readers": [i["ip"] for i in ray.get([r.info.remote() for r in readers])],
    }
    send("ready", **ips)
    version = 1
    while mode := expect_go():
        if mode == "weights":
            version += 1
            handle = trainer.publish.remote(version)
            outcome = {"loads": ray.get([w.load.remote(handle) for w in workers], timeout=300)}
            del handle
        else:
            outcome = fan_out(producer, readers, mode)
        send("done", mode=mode, **outcome)
    return {}


def scenario_fan_out_loss(address: str) -> dict[str, Any]:
    """Rounds of broadcasts until node B (the producer's) is killed midway by the test."""
    producer = Producer.options(**on("nodeB")).remote()
    readers = consumers()
    warm = fan_out(producer, readers, "broadcast")
    send("ready", warm=warm, producer=ray.get(producer.info.remote(), timeout=GET_TIMEOUT_S))
    expect_go()
    outcomes: list[Any] = []
    for _round in range(LOSS_ROUNDS):
        try:
            ref = producer.make_auto.remote("pattern")
            refs = rd.broadcast(ref, readers, timeout=GET_TIMEOUT_S)
        except Exception as exc:  # the producer is gone before this round's read began
            outcomes = [{"error": describe(exc), "seconds": 0.0}] * 4
            break
        send("round", round=_round)
        t0 = time.monotonic()
        pending = [r.check.remote(x, "pattern") for r, x in zip(readers, refs, strict=True)]
        outcomes = []
        for reader_result in pending:
            try:
                outcome: dict[str, Any] = {"mismatch": ray.get(reader_result, timeout=300)}
            except Exception as exc:
                outcome = {"error": describe(exc)}
            outcomes.append({**outcome, "seconds": round(time.monotonic() - t0, 3)})
        del ref, refs, pending
        if any("error" in o for o in outcomes):
            break
    return {"outcomes": outcomes, "held": held_until_released(readers)}


def held_until_released(readers: list[Any], timeout: float = 60.0) -> list[int]:
    """What the readers hold once every relay copy is freed, or at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        held = ray.get([r.held.remote() for r in readers], timeout=GET_TIMEOUT_S)
        if not any(held) or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


SCENARIOS = {"fan_out": scenario_fan_out, "fan_out_loss": scenario_fan_out_loss}


def main() -> None:
    address, scenario = sys.argv[1], sys.argv[2]
    mn_driver.run(address, ("nodeA", "nodeB", "nodeC"), lambda: SCENARIOS[scenario](address))


if __name__ == "__main__":
    main()
