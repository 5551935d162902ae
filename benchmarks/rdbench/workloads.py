"""Workloads 1 to 4, one function each (5 is in ``driver``, 6 in ``weights``, 7 in
``reshard``; ``catalog`` numbers them all).

Every workload times operations end to end as the process that waits for them
sees them, checks every value it moves (``check_pattern`` / ``check_layout``),
and returns one ``Row`` per system and point. A system whose group is not
selected (``--groups``) does not run; one that cannot run here (not installed,
not supported by that system) is a row with ``skipped`` set and a reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
import torch

import raydirect as rd
from rdbench.actors import RAYDIRECT_TRANSPORTS, RECEIVERS
from rdbench.common import (
    DTYPE,
    ELEMENT_BYTES,
    FLOOR_FRESH,
    FLOOR_REUSED,
    GROUP_FLOORS,
    GROUP_NIXL,
    GROUP_RAY,
    GROUP_RAYDIRECT,
    GROUP_RDT,
    KIB,
    OBJECT_STORE,
    PLAIN_CALL,
    RDT_GLOO,
    RDT_NIXL,
    SEED_START,
    SETUP_TIMEOUT_S,
    TRANSFER_TIMEOUT_S,
    Layout,
    Row,
    describe_error,
    fill_pattern,
    format_size,
    layout_bytes,
    log,
    part_seed,
    raydirect_system,
    run_row,
    seeds,
    state_dict_layout,
)
from rdbench.fleet import (
    PRODUCERS_W4,
    Context,
    allocate,
    raydirect_nixl_missing,
    rdt_nixl_missing,
    rdt_ready,
    skip,
)
from rdbench.wire_floors import TCP_ENCRYPTED, TCP_TLS_RECORDS, wire_floors

FLOOR_TORCH_THREADS = 1  # Ray workers run torch with one thread; the floors do too
SMALL_BYTES = 4 * KIB
REFS_PER_PRODUCER_W4 = 2


# ---------------------------------------------------------------- 1: actor -> actor


def actor_to_actor(ctx: Context) -> list[Row]:
    """Workload 1: one tensor, producer actor -> consumer actor, at each size.

    Per transfer, untimed: the producer rewrites its tensor with a new seed. Timed,
    from the driver: ``ray.get(consumer.consume.remote(producer.<method>.remote()))``
    -- the producer's call, the system making the value available, the consumer's
    task, the bytes moving into a receive buffer, and the check. Rows: every
    raydirect transport, Ray's object store, RDT over Gloo (and NIXL), and two
    in-process copy floors."""
    cfg, rows = ctx.config, list[Row]()
    sizes = cfg.sizes

    def pair_rows(producer: Any, consumer: Any, systems: list[tuple[Row, Any, str | None]]) -> None:
        nbytes = systems[0][0].nbytes
        if not allocate([producer], {"x": (nbytes // ELEMENT_BYTES,)}, [s[0] for s in systems]):
            return
        for row, make, missing in systems:
            if skip(row, missing):
                continue

            def transfer(seed: int, make: Any = make) -> float:
                ray.get(producer.prepare.remote(seed), timeout=SETUP_TIMEOUT_S)
                start = time.perf_counter()
                got = ray.get(
                    consumer.consume.remote(make("x"), seed, nbytes), timeout=TRANSFER_TIMEOUT_S
                )
                seconds = time.perf_counter() - start
                if got != nbytes:
                    raise ValueError(f"consumer reported {got} bytes, expected {nbytes}")
                return seconds

            run_row(row, cfg.repeats(nbytes), transfer, ctx.seed_iter)

    def row(system: str, nbytes: int) -> Row:
        r = Row(1, system, format_size(nbytes), nbytes, nbytes)
        rows.append(r)
        return r

    transports = [
        t for t in RAYDIRECT_TRANSPORTS if cfg.wants(GROUP_NIXL if t == "nixl" else GROUP_RAYDIRECT)
    ]
    if transports:
        producer, consumer = ctx.raydirect_pair()
        nixl_missing = raydirect_nixl_missing()
        for n in sizes:
            systems = [
                (
                    row(raydirect_system(t), n),
                    getattr(producer, f"one_{t}").remote,
                    nixl_missing if t == "nixl" else None,
                )
                for t in transports
            ]
            pair_rows(producer, consumer, systems)
        if "tcp" in transports:  # the same, from producers whose stream port encrypts
            for records, system in (("frames", TCP_ENCRYPTED), ("tls", TCP_TLS_RECORDS)):
                sealed = ctx.encrypted_producer(records)
                for n in sizes:
                    pair_rows(sealed, consumer, [(row(system, n), sealed.one_tcp.remote, None)])
    if cfg.wants(GROUP_RAY):
        producer, consumer = ctx.producers(1)[0], ctx.consumers(1)[0]
        for n in sizes:
            pair_rows(producer, consumer, [(row(OBJECT_STORE, n), producer.one.remote, None)])
    rdt_systems = [s for s, g in ((RDT_GLOO, GROUP_RDT), (RDT_NIXL, GROUP_NIXL)) if cfg.wants(g)]
    if rdt_systems:
        rdt_rows = {n: [row(s, n) for s in rdt_systems] for n in sizes}
        actors = rdt_ready(ctx, [r for pair in rdt_rows.values() for r in pair])
        if actors:
            producer, consumer = actors[0], actors[1][0]

            def nixl(name: str) -> Any:
                return producer.one.options(tensor_transport="nixl").remote(name)

            calls = {RDT_GLOO: (producer.one.remote, None), RDT_NIXL: (nixl, rdt_nixl_missing())}
            for family in rdt_rows.values():
                pair_rows(producer, consumer, [(r, *calls[r.system]) for r in family])
    if cfg.wants(GROUP_FLOORS):
        log("w1 floors: in-process copies in the driver")
        for n in sizes:
            rows += copy_floors(n, cfg.repeats(n))
            rows += wire_floors(n, cfg.repeats(n))
    ctx.release()
    return rows


def copy_floors(nbytes: int, repeats: int) -> list[Row]:
    """What the copies an actor -> actor transfer cannot avoid cost in one
    process: one copy into a freshly allocated ``torch.empty`` (page faults
    included), and one copy into memory already touched."""
    threads = torch.get_num_threads()
    torch.set_num_threads(FLOOR_TORCH_THREADS)
    try:
        src = torch.empty(nbytes // ELEMENT_BYTES, dtype=DTYPE)
        fill_pattern(src, SEED_START)
        reused = torch.empty_like(src)
        fill_pattern(reused, 0)  # touched once, before any timing

        def fresh(seed: int) -> float:
            start = time.perf_counter()
            torch.empty_like(src).copy_(src)
            return time.perf_counter() - start

        def again(seed: int) -> float:
            start = time.perf_counter()
            reused.copy_(src)
            return time.perf_counter() - start

        param = format_size(nbytes)
        return [
            run_row(Row(1, FLOOR_FRESH, param, nbytes, nbytes), repeats, fresh, seeds()),
            run_row(Row(1, FLOOR_REUSED, param, nbytes, nbytes), repeats, again, seeds()),
        ]
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------- 2: weight sync


@dataclass(frozen=True)
class WeightSyncSystem:
    """One row family of the weight-sync workload: which actors (``rdt``: Ray's
    RDT set, else raydirect's), the producer method returning the state dict,
    its ``.options(tensor_transport=...)`` if any, how consumers receive it
    (a key of ``actors.RECEIVERS``), and why it cannot run here, if it cannot."""

    system: str
    group: str
    method: str
    receiver: str = "argument"
    rdt: bool = False
    rdt_transport: str | None = None
    missing: Callable[[], str | None] = lambda: None
    broadcast: bool = False  # the driver hands each consumer its ref from rd.broadcast


WEIGHT_SYNC_SYSTEMS = [
    WeightSyncSystem("raydirect auto", GROUP_RAYDIRECT, "state_auto"),
    WeightSyncSystem("raydirect auto, rd.get in consumer", GROUP_RAYDIRECT, "state_auto", "rd.get"),
    WeightSyncSystem("raydirect auto, rd.get into buffers", GROUP_RAYDIRECT, "state_auto", "into"),
    WeightSyncSystem(
        "raydirect auto, rd.get fresh buffers", GROUP_RAYDIRECT, "state_auto", "fresh"
    ),
    WeightSyncSystem(
        "raydirect auto, broadcast into buffers",
        GROUP_RAYDIRECT,
        "state_auto",
        "into",
        broadcast=True,
    ),
    WeightSyncSystem("raydirect tcp", GROUP_RAYDIRECT, "state_tcp"),
    WeightSyncSystem(OBJECT_STORE, GROUP_RAY, "state"),
    WeightSyncSystem(RDT_GLOO, GROUP_RDT, "state", rdt=True),
    WeightSyncSystem(
        RDT_NIXL, GROUP_NIXL, "state", rdt=True, rdt_transport="nixl", missing=rdt_nixl_missing
    ),
]


def weight_sync(ctx: Context) -> list[Row]:
    """Workload 2: a state dict (~200 tensors, Llama-like mixed sizes summing to
    ``--state-size``, 256 MiB by default) from one producer to 1, 2 and 4
    consumers that all read the same ref concurrently.

    Per sync, untimed: the producer rewrites every tensor (a new seed each). Timed,
    from the driver: the producer's call returning the ref, every consumer's
    ``load`` receiving the state dict and checking each tensor, until the last
    consumer is done. GB/s counts the bytes delivered: state size x consumers."""
    cfg, rows = ctx.config, list[Row]()
    layout = state_dict_layout(cfg.state_bytes)
    nbytes = layout_bytes(layout)
    log(f"w2: state dict of {len(layout)} tensors, {format_size(nbytes)}")
    for spec in WEIGHT_SYNC_SYSTEMS:
        if not cfg.wants(spec.group):
            continue
        family = [
            Row(2, spec.system, f"{n} consumer{'s' * (n > 1)}", n, nbytes * n)
            for n in cfg.consumers
        ]
        rows += family
        missing = spec.missing()
        if missing:
            for r in family:
                skip(r, missing)
            continue
        if spec.rdt:
            actors = rdt_ready(ctx, family)
            if actors is None:
                continue
            producer, consumers = actors
        else:
            producer, consumers = ctx.producers(1)[0], ctx.consumers(max(cfg.consumers))
        if not allocate([producer], layout, family):
            continue
        for row, n in zip(family, cfg.consumers, strict=True):
            sync = _sync_operation(spec, producer, consumers[:n], layout, nbytes)
            run_row(row, cfg.sync_steps, sync, ctx.seed_iter)
    ctx.release()
    return rows


def _sync_operation(
    spec: WeightSyncSystem, producer: Any, consumers: list[Any], layout: Layout, nbytes: int
) -> Callable[[int], float]:
    """One timed weight sync: the producer's call, then every consumer's ``load``."""
    method = getattr(producer, spec.method)
    if spec.rdt_transport:
        method = method.options(tensor_transport=spec.rdt_transport)
    boxed = RECEIVERS[spec.receiver].boxed

    def sync(seed: int) -> float:
        ray.get(producer.prepare.remote(seed), timeout=SETUP_TIMEOUT_S)
        start = time.perf_counter()
        ref = method.remote()
        refs = rd.broadcast(ref, consumers) if spec.broadcast else [ref] * len(consumers)
        loads = [
            c.load.remote(spec.receiver, [r] if boxed else r, seed, layout)
            for c, r in zip(consumers, refs, strict=True)
        ]
        got = ray.get(loads, timeout=TRANSFER_TIMEOUT_S)
        seconds = time.perf_counter() - start
        if got != [nbytes] * len(consumers):
            raise ValueError(f"consumers reported {got} bytes, expected {nbytes} each")
        return seconds

    return sync


# ---------------------------------------------------------------- 3: small objects


@dataclass(frozen=True)
class SmallSystem:
    """One row of the small-object workload: the producer method returning a new
    4 KiB tensor, who drives the round trips (``consumer``: the consumer actor
    calls the producer and reads the ref with ``read``; ``driver``: the driver
    calls the producer and passes the ref to ``consumer.consume``), and which
    ``.options(tensor_transport=...)`` an RDT call takes, if any."""

    system: str
    group: str
    method: str
    driver: bool = False
    read: str = "ray.get"  # or "rd.get": how the consumer reads the ref
    rdt_transport: str | None = None
    missing: Callable[[], str | None] = lambda: None


VIA_DRIVER = ", via the driver"
SMALL_SYSTEMS = [
    SmallSystem(raydirect_system("auto"), GROUP_RAYDIRECT, "small_auto", read="rd.get"),
    SmallSystem(raydirect_system("cma"), GROUP_RAYDIRECT, "small_cma", read="rd.get"),
    SmallSystem(PLAIN_CALL, GROUP_RAY, "small"),
    SmallSystem(RDT_GLOO, GROUP_RDT, "small"),
    SmallSystem(RDT_NIXL, GROUP_NIXL, "small", rdt_transport="nixl", missing=rdt_nixl_missing),
    SmallSystem(raydirect_system("auto") + VIA_DRIVER, GROUP_RAYDIRECT, "small_auto", True),
    SmallSystem(PLAIN_CALL + VIA_DRIVER, GROUP_RAY, "small", True),
    SmallSystem(RDT_GLOO + VIA_DRIVER, GROUP_RDT, "small", True),
]


def small_objects(ctx: Context) -> list[Row]:
    """Workload 3: per-object cost. A consumer actor makes ``--round-trips`` round
    trips (1,000 by default): call the producer's method returning a new 4 KiB
    tensor, read the ref (``rd.get`` / ``ray.get``), check it; each round trip is
    timed inside the consumer, the first is the cold one. Rows: raydirect auto, a
    plain Ray actor call (the tensor travels inline in Ray's reply), RDT over Gloo
    and NIXL. Ray's RDT knows collective groups only in the process that created
    them, so an actor cannot call an RDT Gloo method: the ``via the driver`` rows
    time what can run for every system, the driver calling the producer and
    passing the ref to ``consumer.consume`` (one more hop per round trip)."""
    cfg, rows = ctx.config, list[Row]()
    param = format_size(SMALL_BYTES)
    for spec in SMALL_SYSTEMS:
        if not cfg.wants(spec.group):
            continue
        row = Row(3, spec.system, param, SMALL_BYTES, SMALL_BYTES, unit="us")
        rows.append(row)
        if skip(row, spec.missing()):
            continue
        if spec.group == GROUP_RDT or spec.rdt_transport:
            actors = rdt_ready(ctx, [row])
            if actors is None:
                continue
            producer, consumer = actors[0], actors[1][0]
        else:
            producer, consumer = ctx.producers(1)[0], ctx.consumers(1)[0]
        where = f"w3 {spec.system} @ {param}"
        log(f"{where}: {cfg.round_trips} round trips")
        seed0 = next(ctx.seed_iter)
        try:
            if spec.driver:
                times = _driver_round_trips(producer, consumer, spec.method, cfg.round_trips, seed0)
            else:
                numel = SMALL_BYTES // ELEMENT_BYTES
                call = consumer.round_trips.remote(
                    producer, spec.method, spec.read, cfg.round_trips, numel, seed0,
                    spec.rdt_transport,
                )  # fmt: skip
                times = ray.get(call, timeout=TRANSFER_TIMEOUT_S + cfg.round_trips)
            row.cold_s, row.times_s = times[0], times[1:]
            log(f"{where}: median {row.median():.0f} us per round trip")
        except Exception as exc:
            reason = describe_error(exc)
            if (
                spec.rdt_transport is None
                and spec.group == GROUP_RDT
                and ("does not have tensor transport" in reason)
            ):
                skip(
                    row,
                    "an actor cannot call an RDT Gloo method (Ray looks the group up in "
                    f"the caller, and only the driver that created it knows it): {reason}",
                )
            else:
                row.error = reason
                log(f"{where}: FAILED: {row.error}")
    return rows


def _driver_round_trips(
    producer: Any, consumer: Any, method: str, count: int, seed0: int
) -> list[float]:
    """``count`` times, from the driver: ``consumer.consume(producer.<method>())``."""
    call = getattr(producer, method).remote
    times = []
    for i in range(count):
        seed = part_seed(seed0, i)
        start = time.perf_counter()
        got = ray.get(
            consumer.consume.remote(call(seed, SMALL_BYTES // ELEMENT_BYTES), seed, SMALL_BYTES),
            timeout=TRANSFER_TIMEOUT_S,
        )
        times.append(time.perf_counter() - start)
        if got != SMALL_BYTES:
            raise ValueError(f"consumer reported {got} bytes, expected {SMALL_BYTES}")
    return times


# ---------------------------------------------------------------- 4: many refs


def many_refs(ctx: Context) -> list[Row]:
    """Workload 4: concurrency. Four producers return two tensors each
    (``--part-size`` each, 32 MiB by default); one consumer actor reads all 8
    refs with one call and checks them. Timed, from the driver: the 8 producer
    calls until the consumer is done. Rows: raydirect auto read with ``rd.get``
    (fetches run concurrently), the same refs read with ``ray.get`` (raydirect
    fetches each as Ray rebuilds it, one after the other), and Ray's object
    store read with ``ray.get``."""
    cfg, rows = ctx.config, list[Row]()
    nbytes = cfg.part_bytes
    refs = PRODUCERS_W4 * REFS_PER_PRODUCER_W4
    param = f"{refs} x {format_size(nbytes)}"
    layout: Layout = {f"part{j}": (nbytes // ELEMENT_BYTES,) for j in range(REFS_PER_PRODUCER_W4)}
    systems = [
        (raydirect_system("auto") + ", rd.get", GROUP_RAYDIRECT, "one_auto", "rd.get"),
        (raydirect_system("auto") + ", ray.get", GROUP_RAYDIRECT, "one_auto", "ray.get"),
        (OBJECT_STORE, GROUP_RAY, "one", "ray.get"),
    ]
    chosen = [s for s in systems if cfg.wants(s[1])]
    if not chosen:
        return rows
    family = [Row(4, s[0], param, nbytes, nbytes * refs) for s in chosen]
    rows += family
    producers, consumer = ctx.producers(PRODUCERS_W4), ctx.consumers(1)[0]
    if not allocate(producers, layout, family):
        return rows
    for row, (_, _, method, how) in zip(family, chosen, strict=True):

        def read_all(seed: int, method: str = method, how: str = how) -> float:
            ray.get(
                [
                    p.prepare.remote(part_seed(seed, REFS_PER_PRODUCER_W4 * k))
                    for k, p in enumerate(producers)
                ],
                timeout=SETUP_TIMEOUT_S,
            )
            start = time.perf_counter()
            refs = [getattr(p, method).remote(name) for p in producers for name in layout]
            seeds_ = [part_seed(seed, i) for i in range(len(refs))]
            got = ray.get(
                consumer.get_many.remote(how, refs, seeds_, nbytes), timeout=TRANSFER_TIMEOUT_S
            )
            seconds = time.perf_counter() - start
            if got != nbytes * len(refs):
                raise ValueError(f"consumer reported {got} bytes, expected {nbytes * len(refs)}")
            return seconds

        run_row(row, cfg.repeats(nbytes * refs), read_all, ctx.seed_iter)
    ctx.release()
    return rows
