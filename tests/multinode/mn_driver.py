"""Driver scenarios for the multi-node tests; run inside the head's namespace.

    python mn_driver.py ADDRESS SCENARIO

Connects to the cluster at ADDRESS, runs SCENARIO, and reports as JSON lines
on stdout (``@@RD {...}``; see mn_harness.Driver). Every check records what it
saw (or the error it got) instead of stopping the run, so one broken feature
fails one test, not all of them. The actor classes live here (``__main__``), so
Ray ships them to workers by value.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

import ray
import torch

import raydirect as rd

MESSAGE_PREFIX = "@@RD "
GET_TIMEOUT_S = 120.0
PATTERN_BYTES = 64 << 20


def send(event: str, **fields: Any) -> None:
    print(MESSAGE_PREFIX + json.dumps({"event": event, **fields}, default=str), flush=True)


def run(address: str, nodes: tuple[str, ...], scenario: Callable[[], dict[str, Any]]) -> None:
    """A driver's life: join the cluster at ``address``, wait for ``nodes``, send
    what ``scenario()`` returns as the result (or the crash), leave."""
    try:
        ray.init(address=address, logging_level="warning", log_to_driver=True)
        wait_for_nodes(nodes)
        send("result", **scenario())
    except Exception as exc:
        send("crash", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        raise
    finally:
        if ray.is_initialized():
            ray.shutdown()


# ------------------------------------------------------------------ values


def make_value(kind: str) -> Any:
    """Deterministic values; producer and checker build the same one."""
    if kind == "pattern":  # 64 MiB, element i = i * 2654435761 mod 2**31 (no two pages alike)
        n = PATTERN_BYTES // 4
        return (torch.arange(n, dtype=torch.int64) * 2654435761 % (1 << 31)).to(torch.int32)
    if kind == "dtypes":
        g = torch.Generator().manual_seed(11)
        base = torch.randn(300, 17, generator=g)
        return {
            "f32": base,
            "f16": base.half(),
            "bf16": base.bfloat16(),
            "f64": base.double(),
            "i8": (base * 10).to(torch.int8),
            "i64": torch.arange(1000) * -3,
            "bool": base > 0,
            "c64": torch.complex(base, -base),
            "view": base.t()[::2],
            "scalar": torch.tensor(2.5),
            "meta": {"step": 7, "names": ["a", "b"]},
        }
    raise ValueError(kind)


def mismatch(got: Any, want: Any, path: str = "value") -> str | None:
    """None when equal in type, dtype, shape and every element; else where not."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{path}: {type(got).__name__} is not a tensor"
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"{path}: {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"
        return None if torch.equal(got, want) else f"{path}: values differ"
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return f"{path}: keys {sorted(got) if isinstance(got, dict) else got!r}"
        for key in want:
            bad = mismatch(got[key], want[key], f"{path}[{key!r}]")
            if bad:
                return bad
        return None
    return None if got == want else f"{path}: {got!r} != {want!r}"


def received() -> dict[str, int]:
    return dict(rd.local_stats().objects_received)


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    d = Counter(after)
    d.subtract(before)
    return {k: v for k, v in d.items() if v}


# ------------------------------------------------------------------ actors and tasks


class Base:
    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def _value(self, kind: str) -> Any:
        if kind not in self.values:
            self.values[kind] = make_value(kind)
        return self.values[kind]

    @rd.method
    def make_auto(self, kind: str) -> Any:
        return self._value(kind)

    @rd.method(tensor_transport="tcp")
    def make_tcp(self, kind: str) -> Any:
        return self._value(kind)

    @rd.method(tensor_transport="gloo")
    def make_gloo(self, kind: str) -> Any:
        return self._value(kind)

    @rd.method(reads=1)
    def make_once(self, kind: str) -> Any:
        return make_value(kind)

    def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        }

    def stats(self) -> dict[str, int]:
        return received()

    def held(self) -> int:
        """raydirect objects this process holds as a producer (relays' copies too)."""
        return rd.local_stats().num_objects

    def read_nested(self, refs: list, kind: str, transport: str | None = None) -> dict:
        """Read ``refs[0]`` here with rd.get; the counters' change shows the transport."""
        return read_and_check(refs[0], kind, transport)


@ray.remote(num_cpus=0)
class Producer(Base):
    pass


@ray.remote(num_cpus=0)
class Consumer(Base):
    def check(self, value: Any, kind: str) -> str | None:
        """``value`` arrives as a top-level argument: Ray's own resolution fetched it."""
        return mismatch(value, make_value(kind))


@ray.remote(num_cpus=0)
class Caller:
    """Calls a producer on another node and holds what it made (its lease tokens)."""

    def make(self, producer: Any, n: int) -> int:
        self.refs = [producer.make_auto.remote("dtypes") for _ in range(n)]
        ray.wait(self.refs, num_returns=n, timeout=GET_TIMEOUT_S)
        return n

    def drop(self) -> None:
        self.refs = []


def caller_leases_across_nodes(results: dict[str, Any]) -> None:
    """A caller on node A of a producer on node B: its frees cross to B's agent
    (``dropped``), and its death frees what it held (``caller_died``)."""

    def freed_when(drop: Callable[[Any], Any]) -> dict[str, Any]:
        producer = Producer.options(**on("nodeB")).remote()
        caller = Caller.options(**on("nodeA")).remote()
        try:
            ray.get(caller.make.remote(producer, 3), timeout=GET_TIMEOUT_S)
            made = ray.get(producer.held.remote(), timeout=GET_TIMEOUT_S)
            t0 = time.monotonic()
            drop(caller)
            while ray.get(producer.held.remote()) and time.monotonic() < t0 + 60:
                time.sleep(0.05)
            left = ray.get(producer.held.remote(), timeout=GET_TIMEOUT_S)
            return {"made": made, "left": left, "seconds": round(time.monotonic() - t0, 1)}
        finally:
            ray.kill(producer)
            ray.kill(caller)

    def dropped(caller: Any) -> None:
        ray.get(caller.drop.remote())

    attempt(results, "caller_leases/dropped", lambda: freed_when(dropped))
    attempt(results, "caller_leases/caller_died", lambda: freed_when(ray.kill))


def read_once_across_nodes(results: dict[str, Any], producer: Any, consumer: Any) -> None:
    """A reads=1 object made on node B, read on node A (over nixl where installed:
    the producer prepares it on request): its one read frees it; a second read
    names the lifetime. First of the scenario: the producer holds nothing else."""
    ref = producer.make_once.remote("pattern")

    def read() -> dict:
        return ray.get(consumer.read_nested.remote([ref], "pattern"), timeout=GET_TIMEOUT_S)

    def held_after_read() -> int:
        deadline = time.monotonic() + 60
        while ray.get(producer.held.remote()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return ray.get(producer.held.remote(), timeout=GET_TIMEOUT_S)

    attempt(results, "once/first", read)
    attempt(results, "once/held", held_after_read)
    attempt(results, "once/second", read)


def read_and_check(ref: Any, kind: str, transport: str | None = None) -> dict:
    before = received()
    t0 = time.monotonic()
    try:
        value = rd.get(ref, timeout=GET_TIMEOUT_S, tensor_transport=transport)
    except Exception as exc:
        return {"error": describe(exc), "seconds": time.monotonic() - t0}
    return {"mismatch": mismatch(value, make_value(kind)), "received": delta(received(), before)}


@ray.remote(num_cpus=0)
def read_task(refs: list, kind: str) -> dict:
    return {**read_and_check(refs[0], kind), "ip": ray.util.get_node_ip_address()}


@ray.remote(num_cpus=0)
def check_task(value: Any, kind: str) -> str | None:
    return mismatch(value, make_value(kind))


def on(resource: str) -> dict[str, Any]:
    return {"resources": {resource: 0.001}}


def describe(exc: BaseException) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "is_producer_lost": isinstance(exc, rd.ProducerLostError)
        or isinstance(getattr(exc, "cause", None), rd.ProducerLostError),
        "message": str(exc)[-3000:],
    }


def attempt(results: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    """Record ``fn()``'s result, or the error it raised, under ``name``."""
    t0 = time.monotonic()
    try:
        results[name] = fn()
    except Exception as exc:
        results[name] = {"error": describe(exc), "traceback": traceback.format_exc()[-3000:]}
    results[name + ":seconds"] = round(time.monotonic() - t0, 3)


# ------------------------------------------------------------------ scenarios


def wait_for_nodes(resources: tuple[str, ...], timeout: float = 180.0) -> None:
    """Until exactly one live node has each resource (a node killed by an earlier
    test must be declared dead first, or actors could be placed on it)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [n for n in ray.nodes() if n["Alive"]]
        counts = Counter(k for n in alive for k in n["Resources"] if k in resources)
        if all(counts[r] == 1 for r in resources) and len(alive) == len(resources):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"want one live node per {resources} after {timeout}s: {alive}")
        time.sleep(0.2)


def actor_read(consumer: Any, ref: Any, kind: str) -> dict:
    before = ray.get(consumer.stats.remote(), timeout=GET_TIMEOUT_S)
    bad = ray.get(consumer.check.remote(ref, kind), timeout=GET_TIMEOUT_S)
    after = ray.get(consumer.stats.remote(), timeout=GET_TIMEOUT_S)
    return {"mismatch": bad, "received": delta(after, before)}


def driver_read(ref: Any, kind: str) -> dict:
    before = received()
    value = ray.get(ref, timeout=GET_TIMEOUT_S)
    return {"mismatch": mismatch(value, make_value(kind)), "received": delta(received(), before)}


def status_rows(address: str) -> list[dict]:
    """What ``raydirect status --json`` reports for this cluster."""
    proc = subprocess.run(
        [sys.executable, "-m", "raydirect.cli", "status", "--json", "--address", address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"raydirect status failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)["processes"]


def scenario_transfers(address: str) -> dict[str, Any]:
    """Refs made on node B, read on node A by an actor, a task and the driver, over
    auto, tcp and gloo; same-node reads; raydirect status."""
    results: dict[str, Any] = {}
    producer = Producer.options(**on("nodeB")).remote()
    consumer = Consumer.options(**on("nodeA")).remote()
    results["producer"] = ray.get(producer.info.remote(), timeout=GET_TIMEOUT_S)
    results["consumer"] = ray.get(consumer.info.remote(), timeout=GET_TIMEOUT_S)
    results["driver"] = {"ip": ray.util.get_node_ip_address()}
    read_once_across_nodes(results, producer, consumer)

    on_a = on("nodeA")
    for kind in ("pattern", "dtypes"):
        ref = producer.make_auto.remote(kind)
        checks: dict[str, Callable[[], Any]] = {
            "actor": lambda ref=ref, kind=kind: actor_read(consumer, ref, kind),
            "task": lambda ref=ref, kind=kind: ray.get(
                read_task.options(**on_a).remote([ref], kind), timeout=GET_TIMEOUT_S
            ),
            "task_arg": lambda ref=ref, kind=kind: ray.get(
                check_task.options(**on_a).remote(ref, kind), timeout=GET_TIMEOUT_S
            ),
            "driver": lambda ref=ref, kind=kind: driver_read(ref, kind),
        }
        for reader, check in checks.items():
            attempt(results, f"auto/{kind}/{reader}", check)
        ref = producer.make_tcp.remote(kind)
        attempt(results, f"tcp/{kind}/actor", lambda r=ref, k=kind: actor_read(consumer, r, k))
        attempt(results, f"tcp/{kind}/driver", lambda r=ref, k=kind: driver_read(r, k))
        del ref, checks

    # Same node: a task on node B reads B's object; node A's consumer reads the driver's put.
    ref = producer.make_auto.remote("dtypes")
    attempt(
        results,
        "auto/same_node_B/task",
        lambda r=ref: ray.get(
            read_task.options(**on("nodeB")).remote([r], "dtypes"), timeout=GET_TIMEOUT_S
        ),
    )
    put_ref = rd.put(make_value("dtypes"))
    attempt(results, "auto/same_node_A/actor", lambda r=put_ref: actor_read(consumer, r, "dtypes"))
    del ref, put_ref

    # Gloo across nodes, with no GLOO_SOCKET_IFNAME anywhere.
    attempt(
        results,
        "gloo/group",
        lambda: rd.create_collective_group([consumer, producer], backend="gloo", name="ab"),
    )
    for kind in ("pattern", "dtypes"):
        ref = producer.make_gloo.remote(kind)
        attempt(results, f"gloo/{kind}/actor", lambda r=ref, k=kind: actor_read(consumer, r, k))
        attempt(results, f"gloo/{kind}/driver", lambda r=ref, k=kind: driver_read(r, k))
        del ref

    encrypting_consumer_reads(results, producer, consumer)
    caller_leases_across_nodes(results)

    # raydirect status sees both nodes' agents at their nodes' addresses.
    attempt(results, "status", lambda: status_rows(address))
    return results


def encrypting_consumer_reads(results: dict[str, Any], producer: Any, consumer: Any) -> None:
    """A consumer on node A that encrypts (RAYDIRECT_ENCRYPT=1) reads node B's clear
    producer (refused), an encrypting producer on node B, and a clear producer on
    its own node; another one, with RAYDIRECT_ALLOW_CLEAR=1, reads B's clear one."""
    encrypt = {"RAYDIRECT_ENCRYPT": "1"}
    strict = Consumer.options(**on("nodeA"), runtime_env={"env_vars": encrypt}).remote()
    mixed_env = {"env_vars": {**encrypt, "RAYDIRECT_ALLOW_CLEAR": "1"}}
    mixed = Consumer.options(**on("nodeA"), runtime_env=mixed_env).remote()
    sealed = Producer.options(**on("nodeB"), runtime_env={"env_vars": encrypt}).remote()
    reads = {
        "clear_across": (strict, producer),
        "sealed_across": (strict, sealed),
        "clear_same_node": (strict, consumer),
        "allowed_clear_across": (mixed, producer),
    }
    for name, (reader, maker) in reads.items():
        ref = maker.make_tcp.remote("pattern")
        attempt(
            results,
            f"encrypting/{name}",
            lambda r=reader, ref=ref: ray.get(
                r.read_nested.remote([ref], "pattern"), timeout=GET_TIMEOUT_S
            ),
        )
        del ref
    for actor in (strict, mixed, sealed):
        ray.kill(actor)


def scenario_node_loss(address: str) -> dict[str, Any]:
    """Objects of node B referenced on node A when node B's processes are killed."""
    results: dict[str, Any] = {}
    producer = Producer.options(**on("nodeB")).remote()
    neighbour = Producer.options(**on("nodeB")).remote()  # reads over shm: makes segments
    consumer = Consumer.options(**on("nodeA")).remote()
    info = ray.get(producer.info.remote(), timeout=GET_TIMEOUT_S)
    neighbour_info = ray.get(neighbour.info.remote(), timeout=GET_TIMEOUT_S)
    ref = producer.make_auto.remote("pattern")
    small = producer.make_tcp.remote("dtypes")
    warm = actor_read(consumer, ref, "pattern")  # the consumer has talked to B's agent
    shm_read = ray.get(neighbour.read_nested.remote([ref], "pattern", "shm"), timeout=120)
    ray.get(consumer.info.remote(), timeout=GET_TIMEOUT_S)
    send(
        "ready",
        producer=info,
        neighbour=neighbour_info,
        warm=warm,
        shm_read=shm_read,
        segments=sorted(  # staged segments (not the slab of its seals)
            n
            for n in os.listdir("/dev/shm")
            if n.startswith(f"rd-{info['pid']}-") and "-seals-" not in n
        ),
    )
    if sys.stdin.readline().strip() != "go":
        raise RuntimeError("the test did not say go")

    # All three readers start at once; each must fail within the bound on its own.
    t0 = time.monotonic()
    in_actor = consumer.check.remote(ref, "pattern")
    in_task = read_task.options(**on("nodeA")).remote([small], "dtypes")
    readers: dict[str, Callable[[], Any]] = {
        "driver": lambda: driver_read(ref, "pattern"),
        "actor": lambda: ray.get(in_actor, timeout=GET_TIMEOUT_S),
        "task": lambda: ray.get(in_task, timeout=GET_TIMEOUT_S),
    }
    for reader, read in readers.items():
        attempt(results, reader, read)
        results[f"{reader}:seconds"] = round(time.monotonic() - t0, 3)  # from the start
    # The surviving node still works: a new actor there (a new agent, whose start
    # sweeps what dead processes left) and a transfer within node A.
    fresh = Producer.options(**on("nodeA")).remote()
    attempt(
        results,
        "survivor",
        lambda: ray.get(
            consumer.check.remote(fresh.make_auto.remote("dtypes"), "dtypes"), timeout=120
        ),
    )
    results["consumer_stats"] = ray.get(consumer.stats.remote(), timeout=GET_TIMEOUT_S)
    return results


SCENARIOS = {"transfers": scenario_transfers, "node_loss": scenario_node_loss}


def main() -> None:
    address, scenario = sys.argv[1], sys.argv[2]
    run(address, ("nodeA", "nodeB"), lambda: SCENARIOS[scenario](address))


if __name__ == "__main__":
    main()
