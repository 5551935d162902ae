"""The five workloads, one function each, and the actors they share.

Every workload times operations end to end as the process that waits for them
sees them, checks every value it moves (``check_pattern`` / ``check_layout``),
and returns one ``Row`` per system and point. A system whose group is not
selected (``--groups``) does not run; one that cannot run here (not installed,
not supported by that system) is a row with ``skipped`` set and a reason.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

import raydirect as rd
from rdbench.actors import (
    RAYDIRECT_TRANSPORTS,
    RECEIVERS,
    Consumer,
    Producer,
    RdtConsumer,
    RdtProducer,
)
from rdbench.common import (
    DTYPE,
    ELEMENT_BYTES,
    FLOOR_FRESH,
    FLOOR_REUSED,
    GROUP_FLOORS,
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
    Workload,
    check_pattern,
    describe_error,
    fill_pattern,
    format_size,
    log,
    part_seed,
    raydirect_system,
    run_row,
    seeds,
    state_dict_layout,
)

RAYDIRECT_GROUP = "bench-raydirect"
FLOOR_TORCH_THREADS = 1  # Ray workers run torch with one thread; the floors do too
SMALL_BYTES = 4 * KIB
PRODUCERS_W4 = 4
REFS_PER_PRODUCER_W4 = 2


@dataclass
class Config:
    """What to run (from the command line)."""

    workloads: list[int]
    groups: list[str]
    sizes: list[int]  # workload 1
    repeats: Callable[[int], int]  # timed repeats after the cold one, by bytes moved
    state_bytes: int  # workload 2
    consumers: list[int]  # workload 2
    round_trips: int  # workload 3
    part_bytes: int  # workload 4, per ref
    driver_bytes: int  # workload 5

    def wants(self, group: str) -> bool:
        return group in self.groups


def raydirect_nixl_missing() -> str | None:
    """Why raydirect's ``nixl`` transport cannot run here, or None."""
    from raydirect.transports import nixl

    return None if nixl.available() else f"NIXL not installed: {nixl.INSTALL_HINT}"


def rdt_nixl_missing() -> str | None:
    """Why Ray's RDT over NIXL cannot run here, or None: Ray imports ``nixl._api``."""
    if importlib.util.find_spec("nixl") is None:
        return (
            "Ray's RDT nixl needs the `nixl` python package (it imports nixl._api), "
            "not installed: pip install nixl"
        )
    return None


@dataclass
class Context:
    """The configuration, the run's seeds, and the actors shared by the workloads:
    all started at once by ``start`` in the one Ray session, killed by ``close``."""

    config: Config
    seed_iter: Iterator[int] = field(default_factory=seeds)
    _producers: list[Any] = field(default_factory=list)
    _consumers: list[Any] = field(default_factory=list)
    _rdt_actors: list[Any] = field(default_factory=list)  # producer, then consumers
    _rdt_group: Any = None
    _rd_group: bool = False

    def start(self) -> None:
        """Start every actor the chosen workloads need at once: each takes seconds
        to import torch, and in parallel those seconds overlap."""
        cfg = self.config
        consumers = max(cfg.consumers) if 2 in cfg.workloads else 1
        if cfg.wants(GROUP_RDT) and set(cfg.workloads) & {1, 2, 3, 5}:
            log(f"starting RDT's producer and {consumers} consumer(s)")
            self._rdt_actors = [RdtProducer.remote()]
            self._rdt_actors += [RdtConsumer.remote() for _ in range(consumers)]
        if cfg.wants(GROUP_RAYDIRECT) or cfg.wants(GROUP_RAY):
            producers = PRODUCERS_W4 if 4 in cfg.workloads else 1
            self.producers(producers, wait=False)
            self.consumers(consumers, wait=False)
        actors = [*self._producers, *self._consumers, *self._rdt_actors]
        ray.get([a.__ray_ready__.remote() for a in actors], timeout=SETUP_TIMEOUT_S)

    def _grow(self, actors: list[Any], cls: Any, n: int, what: str, wait: bool) -> list[Any]:
        if len(actors) < n:
            log(f"starting {n - len(actors)} {what}")
            new = [cls.remote() for _ in range(n - len(actors))]
            actors += new
            if wait:
                ray.get([a.__ray_ready__.remote() for a in new], timeout=SETUP_TIMEOUT_S)
        return actors[:n]

    def producers(self, n: int, wait: bool = True) -> list[Any]:
        """raydirect + plain-Ray producers (``actors.Producer``)."""
        return self._grow(self._producers, Producer, n, "producer(s)", wait)

    def consumers(self, n: int, wait: bool = True) -> list[Any]:
        return self._grow(self._consumers, Consumer, n, "consumer(s)", wait)

    def raydirect_pair(self) -> tuple[Any, Any]:
        """Producer 0 and consumer 0, in one raydirect Gloo group (for ``gloo``)."""
        producer, consumer = self.producers(1)[0], self.consumers(1)[0]
        if not self._rd_group:
            rd.create_collective_group([producer, consumer], backend="gloo", name=RAYDIRECT_GROUP)
            self._rd_group = True
        return producer, consumer

    def rdt(self) -> tuple[Any, list[Any]]:
        """RDT's producer and consumers, all in one Ray collective group (torch_gloo):
        as many consumers as weight sync needs, or one."""
        if not self._rdt_actors:
            raise RuntimeError("RDT actors were not started (Context.start)")
        if self._rdt_group is None:
            from ray.experimental.collective import create_collective_group

            log(f"RDT: creating the collective group of {len(self._rdt_actors)} actors")
            ray.get([a.__ray_ready__.remote() for a in self._rdt_actors], timeout=SETUP_TIMEOUT_S)
            self._rdt_group = create_collective_group(self._rdt_actors, backend="torch_gloo")
        return self._rdt_actors[0], self._rdt_actors[1:]

    def release(self) -> None:
        """Drop every producer's tensors (between workloads)."""
        producers = [*self._producers, *self._rdt_actors[:1]]
        try:
            ray.get([p.release.remote() for p in producers], timeout=SETUP_TIMEOUT_S)
        except Exception as exc:
            log(f"releasing producers' tensors failed: {describe_error(exc)}")

    def close(self) -> None:
        if self._producers:
            try:
                log(f"raydirect producer 0 stats: {ray.get(self._producers[0].stats.remote())}")
            except Exception as exc:
                log(f"raydirect stats unavailable: {describe_error(exc)}")
        if self._rd_group:
            rd.destroy_collective_group(RAYDIRECT_GROUP)
        if self._rdt_group is not None:
            from ray.experimental.collective import destroy_collective_group

            try:
                destroy_collective_group(self._rdt_group)
            except Exception as exc:  # e.g. RDT already tore it down after a failure
                log(f"RDT: destroy_collective_group: {describe_error(exc)}")
        for actor in [*self._producers, *self._consumers, *self._rdt_actors]:
            ray.kill(actor)


def _rdt_ready(ctx: Context, rows: Sequence[Row]) -> tuple[Any, list[Any]] | None:
    """RDT's actors, or None after marking ``rows`` failed with the reason."""
    try:
        return ctx.rdt()
    except Exception as exc:
        reason = f"RDT setup failed: {describe_error(exc)}"
        log(reason)
        for row in rows:
            row.error = reason
        return None


def _allocate(producers: Sequence[Any], layout: Layout, rows: Sequence[Row]) -> bool:
    try:
        ray.get([p.allocate.remote(layout) for p in producers], timeout=SETUP_TIMEOUT_S)
        return True
    except Exception as exc:
        reason = f"producer setup failed: {describe_error(exc)}"
        log(reason)
        for row in rows:
            row.error = reason
        return False


def _skip(row: Row, reason: str | None) -> bool:
    if reason:
        row.skipped = reason
        log(f"w{row.workload} {row.system} @ {row.param}: skipped: {reason}")
    return bool(reason)


# ---------------------------------------------------------------- 1: actor -> actor


def actor_to_actor(ctx: Context) -> list[Row]:
    """Workload 1: one tensor, producer actor -> consumer actor, at each size.

    Per transfer, untimed: the producer rewrites its tensor with a new seed. Timed,
    from the driver: ``ray.get(consumer.consume.remote(producer.<method>.remote()))``
    -- the producer's call, the system making the value available, the consumer's
    task, the bytes moving into a receive buffer, and the check. Rows: every
    raydirect transport, Ray's object store, RDT over Gloo (and NIXL), and two
    in-process copy floors."""
    cfg, rows = ctx.config, []
    sizes = cfg.sizes

    def pair_rows(producer: Any, consumer: Any, systems: list[tuple[Row, Any, str | None]]) -> None:
        nbytes = systems[0][0].nbytes
        if not _allocate([producer], {"x": (nbytes // ELEMENT_BYTES,)}, [s[0] for s in systems]):
            return
        for row, make, missing in systems:
            if _skip(row, missing):
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

    if cfg.wants(GROUP_RAYDIRECT):
        producer, consumer = ctx.raydirect_pair()
        nixl_missing = raydirect_nixl_missing()
        for n in sizes:
            systems = [
                (
                    row(raydirect_system(t), n),
                    getattr(producer, f"one_{t}").remote,
                    nixl_missing if t == "nixl" else None,
                )
                for t in RAYDIRECT_TRANSPORTS
            ]
            pair_rows(producer, consumer, systems)
    if cfg.wants(GROUP_RAY):
        producer, consumer = ctx.producers(1)[0], ctx.consumers(1)[0]
        for n in sizes:
            pair_rows(producer, consumer, [(row(OBJECT_STORE, n), producer.one.remote, None)])
    if cfg.wants(GROUP_RDT):
        rdt_rows = {n: (row(RDT_GLOO, n), row(RDT_NIXL, n)) for n in sizes}
        actors = _rdt_ready(ctx, [r for pair in rdt_rows.values() for r in pair])
        if actors:
            producer, consumer = actors[0], actors[1][0]

            def nixl(name: str) -> Any:
                return producer.one.options(tensor_transport="nixl").remote(name)

            for gloo_row, nixl_row in rdt_rows.values():
                pair_rows(
                    producer,
                    consumer,
                    [(gloo_row, producer.one.remote, None), (nixl_row, nixl, rdt_nixl_missing())],
                )
    if cfg.wants(GROUP_FLOORS):
        log("w1 floors: in-process copies in the driver")
        for n in sizes:
            rows += copy_floors(n, cfg.repeats(n))
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


WEIGHT_SYNC_SYSTEMS = [
    WeightSyncSystem("raydirect auto", GROUP_RAYDIRECT, "state_auto"),
    WeightSyncSystem("raydirect auto, rd.get in consumer", GROUP_RAYDIRECT, "state_auto", "rd.get"),
    WeightSyncSystem("raydirect tcp", GROUP_RAYDIRECT, "state_tcp"),
    WeightSyncSystem(OBJECT_STORE, GROUP_RAY, "state"),
    WeightSyncSystem(RDT_GLOO, GROUP_RDT, "state", rdt=True),
    WeightSyncSystem(
        RDT_NIXL, GROUP_RDT, "state", rdt=True, rdt_transport="nixl", missing=rdt_nixl_missing
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
    cfg, rows = ctx.config, []
    layout = state_dict_layout(cfg.state_bytes)
    log(f"w2: state dict of {len(layout)} tensors, {format_size(cfg.state_bytes)}")
    for spec in WEIGHT_SYNC_SYSTEMS:
        if not cfg.wants(spec.group):
            continue
        family = [
            Row(2, spec.system, f"{n} consumer{'s' * (n > 1)}", n, cfg.state_bytes * n)
            for n in cfg.consumers
        ]
        rows += family
        missing = spec.missing()
        if missing:
            for r in family:
                _skip(r, missing)
            continue
        if spec.rdt:
            actors = _rdt_ready(ctx, family)
            if actors is None:
                continue
            producer, consumers = actors
        else:
            producer, consumers = ctx.producers(1)[0], ctx.consumers(max(cfg.consumers))
        if not _allocate([producer], layout, family):
            continue
        for row, n in zip(family, cfg.consumers, strict=True):
            sync = _sync_operation(spec, producer, consumers[:n], layout, cfg.state_bytes)
            run_row(row, cfg.repeats(cfg.state_bytes), sync, ctx.seed_iter)
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
        arg = [ref] if boxed else ref
        loads = [c.load.remote(spec.receiver, arg, seed, layout) for c in consumers]
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
    SmallSystem(PLAIN_CALL, GROUP_RAY, "small"),
    SmallSystem(RDT_GLOO, GROUP_RDT, "small"),
    SmallSystem(RDT_NIXL, GROUP_RDT, "small", rdt_transport="nixl", missing=rdt_nixl_missing),
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
    cfg, rows = ctx.config, []
    param = format_size(SMALL_BYTES)
    for spec in SMALL_SYSTEMS:
        if not cfg.wants(spec.group):
            continue
        row = Row(3, spec.system, param, SMALL_BYTES, SMALL_BYTES, unit="us")
        rows.append(row)
        if _skip(row, spec.missing()):
            continue
        if spec.group == GROUP_RDT:
            actors = _rdt_ready(ctx, [row])
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
                target = _Options(producer, spec.rdt_transport) if spec.rdt_transport else producer
                numel = SMALL_BYTES // ELEMENT_BYTES
                call = consumer.round_trips.remote(
                    target, spec.method, spec.read, cfg.round_trips, numel, seed0
                )
                times = ray.get(call, timeout=TRANSFER_TIMEOUT_S + cfg.round_trips)
            row.cold_s, row.times_s = times[0], times[1:]
            log(f"{where}: median {row.median():.0f} us per round trip")
        except Exception as exc:
            reason = describe_error(exc)
            if spec.group == GROUP_RDT and "does not have tensor transport" in reason:
                _skip(row, f"an actor cannot call an RDT method; Ray says {reason}")
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


class _Options:
    """Stands for an actor handle whose methods are called with fixed ``.options``."""

    def __init__(self, actor: Any, tensor_transport: str) -> None:
        self.actor, self.tensor_transport = actor, tensor_transport

    def __getattr__(self, name: str) -> Any:
        return getattr(self.actor, name).options(tensor_transport=self.tensor_transport)


# ---------------------------------------------------------------- 4: many refs


def many_refs(ctx: Context) -> list[Row]:
    """Workload 4: concurrency. Four producers return two tensors each
    (``--part-size`` each, 32 MiB by default); one consumer actor reads all 8
    refs with one call and checks them. Timed, from the driver: the 8 producer
    calls until the consumer is done. Rows: raydirect auto read with ``rd.get``
    (fetches run concurrently), the same refs read with ``ray.get`` (raydirect
    fetches each as Ray rebuilds it, one after the other), and Ray's object
    store read with ``ray.get``."""
    cfg, rows = ctx.config, []
    nbytes = cfg.part_bytes
    refs = PRODUCERS_W4 * REFS_PER_PRODUCER_W4
    param = f"{refs} x {format_size(nbytes)}"
    layout = {f"part{j}": (nbytes // ELEMENT_BYTES,) for j in range(REFS_PER_PRODUCER_W4)}
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
    if not _allocate(producers, layout, family):
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


# ---------------------------------------------------------------- 5: to the driver


def to_driver(ctx: Context) -> list[Row]:
    """Workload 5: the driver reads one large tensor (``--driver-size``, 512 MiB by
    default). Timed: the producer's call until the value is in the driver and
    checked. Rows: raydirect auto (``rd.get``), Ray's object store (``ray.get``),
    RDT over Gloo (Ray refuses ``ray.get`` of a two-sided RDT object; the row says
    so, and ``ray.get(..., _use_object_store=True)``, its fallback through the
    object store, is measured as its own row) and RDT over NIXL (one-sided)."""
    cfg, rows = ctx.config, []
    nbytes = cfg.driver_bytes
    param = format_size(nbytes)
    layout = {"x": (nbytes // ELEMENT_BYTES,)}

    def measure(
        row: Row, producer: Any, make: Callable[[], Any], read: Callable[[Any], Any]
    ) -> Row:
        def transfer(seed: int) -> float:
            ray.get(producer.prepare.remote(seed), timeout=SETUP_TIMEOUT_S)
            start = time.perf_counter()
            value = read(make())
            check_pattern(value, seed, nbytes)
            seconds = time.perf_counter() - start
            del value
            return seconds

        return run_row(row, cfg.repeats(nbytes), transfer, ctx.seed_iter)

    def row(system: str) -> Row:
        r = Row(5, system, param, nbytes, nbytes)
        rows.append(r)
        return r

    def rd_get(ref: Any) -> Any:
        return rd.get(ref, timeout=TRANSFER_TIMEOUT_S)

    def ray_get(ref: Any) -> Any:
        return ray.get(ref, timeout=TRANSFER_TIMEOUT_S)

    if cfg.wants(GROUP_RAYDIRECT) or cfg.wants(GROUP_RAY):
        producer = ctx.producers(1)[0]
        wanted = [
            (raydirect_system("auto"), GROUP_RAYDIRECT, "one_auto", rd_get),
            (OBJECT_STORE, GROUP_RAY, "one", ray_get),
        ]
        chosen = [(row(s), m, r) for s, g, m, r in wanted if cfg.wants(g)]
        if _allocate([producer], layout, [c[0] for c in chosen]):
            for r, method, read in chosen:
                measure(r, producer, lambda m=method: getattr(producer, m).remote("x"), read)
    if cfg.wants(GROUP_RDT):
        gloo = row(RDT_GLOO)
        fallback = row(RDT_GLOO + ", _use_object_store=True")
        nixl = row(RDT_NIXL)
        actors = _rdt_ready(ctx, [gloo, fallback, nixl])
        if actors and _allocate([actors[0]], layout, [gloo, fallback, nixl]):
            producer = actors[0]
            refusal = rdt_driver_refusal(producer)
            if refusal is None:
                measure(gloo, producer, lambda: producer.one.remote("x"), ray_get)
            elif "two-sided" in refusal:  # by design: say so, do not count it as a failure
                _skip(gloo, f"RDT cannot deliver a Gloo object to the driver; Ray says {refusal}")
            else:
                gloo.error = refusal
            measure(
                fallback,
                producer,
                lambda: producer.one.remote("x"),
                lambda ref: ray.get(ref, timeout=TRANSFER_TIMEOUT_S, _use_object_store=True),
            )
            if not _skip(nixl, rdt_nixl_missing()):
                make = producer.one.options(tensor_transport="nixl").remote
                measure(nixl, producer, lambda: make("x"), ray_get)
    ctx.release()
    return rows


def rdt_driver_refusal(producer: Any) -> str | None:
    """Try ``ray.get`` of an RDT Gloo object in the driver: None if it worked,
    else the error (Ray 2.60 refuses two-sided transports there)."""
    ref = producer.one.remote("x")
    try:
        ray.get(ref, timeout=TRANSFER_TIMEOUT_S)
    except Exception as exc:
        return describe_error(exc)
    finally:
        del ref
    return None


WORKLOADS = {
    w.number: w
    for w in [
        Workload(
            1,
            "actor -> actor, one tensor",
            "size",
            "GB/s",
            (OBJECT_STORE, RDT_GLOO),
            actor_to_actor,
        ),
        Workload(
            2,
            "weight sync: one state dict to N consumers",
            "consumers",
            "GB/s",
            (OBJECT_STORE, RDT_GLOO),
            weight_sync,
        ),
        Workload(
            3,
            "small objects: 4 KiB round trips",
            "size",
            "us",
            (PLAIN_CALL, PLAIN_CALL + VIA_DRIVER),
            small_objects,
        ),
        Workload(
            4,
            "8 refs from 4 producers, read with one call",
            "refs",
            "GB/s",
            (OBJECT_STORE,),
            many_refs,
        ),
        Workload(
            5, "the driver reads one large tensor", "size", "GB/s", (OBJECT_STORE,), to_driver
        ),
    ]
}
