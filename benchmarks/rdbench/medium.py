"""Workload 8: medium transfers, 4 KiB to 16 MiB, at the cost of the calls they ride on.

The question (issues 33 and 41): what does a tensor of 1-16 MiB add to the two
Ray calls that move it? A producer method returns the tensor, a consumer method
takes it as a task argument; the same two calls returning an int are the
baseline, and one in-process copy into fresh memory is the floor of what the
bytes themselves cost. raydirect runs twice: with its default lifetime (a
lease) and with ``@rd.method(reads=1, ttl=60)`` (none).

The systems run in blocks: ``_BLOCK`` consecutive transfers of one system (the
first ``_WARM`` not counted), systems rotating, until each has ``--rounds``
counted. Alternating call by call would charge each system's background work
(a lease's release, plasma eviction, pubsub) to whichever ran next, the bare
calls included (issue 41). Rotating blocks still spread a slow spell of the
machine over all of them. The table gives medians, and its summary the
issue's targets with the floor's own ratio beside each.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
import torch

from rdbench.common import (
    DTYPE,
    ELEMENT_BYTES,
    GROUP_FLOORS,
    GROUP_RAY,
    GROUP_RAYDIRECT,
    GROUP_RDT,
    MIB,
    OBJECT_STORE,
    RDT_GLOO,
    SEED_START,
    SETUP_TIMEOUT_S,
    TRANSFER_TIMEOUT_S,
    Row,
    describe_error,
    fill_pattern,
    format_size,
    log,
    raydirect_system,
)
from rdbench.fleet import Context, allocate, rdt_ready
from rdbench.report import TargetLine, render_targets

TWO_CALLS = "the two calls, returning an int"
FLOOR_ONE_COPY = "floor: one copy into fresh memory"
RAYDIRECT_AUTO = raydirect_system("auto")
RAYDIRECT_READ_ONCE = "raydirect auto, reads=1 (no lease)"
_BLOCK, _WARM = 10, 2  # transfers per block, and those of each block not counted
FLOOR_THREADS = 1  # Ray workers run torch with one thread; the floor does too
TENSOR = "x"  # the producer's one tensor at each size


def _systems(ctx: Context) -> list[tuple[str, str]]:
    """(system, group) of every row this run measures, in the order of a round."""
    every = [
        (TWO_CALLS, GROUP_RAY),
        (RAYDIRECT_AUTO, GROUP_RAYDIRECT),
        (RAYDIRECT_READ_ONCE, GROUP_RAYDIRECT),
        (OBJECT_STORE, GROUP_RAY),
        (RDT_GLOO, GROUP_RDT),
        (FLOOR_ONE_COPY, GROUP_FLOORS),
    ]
    return [(s, g) for s, g in every if ctx.config.wants(g)]


def medium(ctx: Context) -> list[Row]:
    """Workload 8: at each of ``--medium-sizes``, ``--rounds`` counted transfers
    per system, in blocks (the module's docstring). Timed from the driver, per transfer:
    ``ray.get(consumer.<take>.remote(producer.<method>.remote("x"), seed, n))``;
    untimed before it, the producer waits until no object holds its tensor and
    rewrites it with a new seed, and the consumer checks what it took against
    that seed. Rows: the two calls returning an int (the baseline), raydirect
    auto with its lease and with ``reads=1``, Ray's object store, Ray's RDT
    over gloo, and the floor (in the driver, ``torch.empty_like(src).copy_(src)``)."""
    cfg, rows = ctx.config, list[Row]()
    systems = _systems(ctx)
    if not systems:
        return rows
    producer = consumer = rdt = None
    if any(g in (GROUP_RAY, GROUP_RAYDIRECT) for _, g in systems):
        producer, consumer = ctx.producers(1)[0], ctx.consumers(1)[0]
    for nbytes in cfg.medium_sizes:
        family = {s: Row(8, s, format_size(nbytes), nbytes, nbytes, unit="us") for s, _ in systems}
        rows += family.values()
        layout = {TENSOR: (nbytes // ELEMENT_BYTES,)}
        if producer is not None and not allocate([producer], layout, list(family.values())):
            continue
        if RDT_GLOO in family:
            actors = rdt_ready(ctx, [family[RDT_GLOO]])
            rdt = actors if actors is None else (actors[0], actors[1][0])
            if rdt is not None and not allocate([rdt[0]], layout, [family[RDT_GLOO]]):
                rdt = None
        operations = _operations(producer, consumer, rdt, nbytes)
        _rounds(ctx, family, operations, cfg.medium_rounds)
    ctx.release()
    return rows


def _operations(
    producer: Any, consumer: Any, rdt: tuple[Any, Any] | None, nbytes: int
) -> dict[str, Callable[[int], float]]:
    """One timed transfer of each system at ``nbytes``: seed in, seconds out."""

    def through(owner: Any, method: Any, take: Any) -> Callable[[int], float]:
        def transfer(seed: int) -> float:
            ray.get(owner.prepare.remote(seed), timeout=SETUP_TIMEOUT_S)
            start = time.perf_counter()
            got = ray.get(take(method(TENSOR), seed, nbytes), timeout=TRANSFER_TIMEOUT_S)
            seconds = time.perf_counter() - start
            if got != nbytes:
                raise ValueError(f"the consumer reported {got} bytes, expected {nbytes}")
            return seconds

        return transfer

    ops: dict[str, Callable[[int], float]] = {FLOOR_ONE_COPY: _floor(nbytes)}
    if producer is not None:
        ops[TWO_CALLS] = through(producer, producer.number.remote, consumer.take_number.remote)
        ops[RAYDIRECT_AUTO] = through(producer, producer.one_auto.remote, consumer.consume.remote)
        once = producer.one_read_once.remote
        ops[RAYDIRECT_READ_ONCE] = through(producer, once, consumer.consume.remote)
        ops[OBJECT_STORE] = through(producer, producer.one.remote, consumer.consume.remote)
    if rdt is not None:
        ops[RDT_GLOO] = through(rdt[0], rdt[0].one.remote, rdt[1].consume.remote)
    return ops


def _floor(nbytes: int) -> Callable[[int], float]:
    """One copy into a new ``torch.empty`` in this process, page faults included."""
    src = torch.empty(nbytes // ELEMENT_BYTES, dtype=DTYPE)
    fill_pattern(src, SEED_START)

    def copy(seed: int) -> float:
        threads = torch.get_num_threads()
        torch.set_num_threads(FLOOR_THREADS)
        try:
            start = time.perf_counter()
            torch.empty_like(src).copy_(src)
            return time.perf_counter() - start
        finally:
            torch.set_num_threads(threads)

    return copy


def _rounds(
    ctx: Context, family: dict[str, Row], ops: dict[str, Callable[[int], float]], rounds: int
) -> None:
    """One cold transfer of each system, then blocks until each system has
    ``rounds`` counted; a system that fails leaves, the others go on."""
    live = [s for s in family if s in ops and family[s].error is None]
    for s in family:
        if s not in ops and family[s].error is None:
            family[s].error = "its actors did not start"
    point = next(iter(family.values())).param
    log(f"w8 @ {point}: {len(live)} systems, 1 cold + {rounds} each, blocks of {_BLOCK}")
    _block(ctx, family, ops, live, 1, cold=True)
    counted = _BLOCK - _WARM
    for done in range(0, rounds, counted):
        _block(ctx, family, ops, live, _WARM + min(counted, rounds - done), cold=False)
    for system in live:
        log(f"w8 {system} @ {point}: median {family[system].median():.0f} us")


def _block(
    ctx: Context,
    family: dict[str, Row],
    ops: dict[str, Callable[[int], float]],
    live: list[str],
    size: int,
    cold: bool,
) -> None:
    """``size`` consecutive transfers of each live system in turn: the first
    one's time is its cold time if ``cold``, else the first ``_WARM`` are not counted."""
    for system in list(live):
        for i in range(size):
            try:
                seconds = ops[system](next(ctx.seed_iter))
            except Exception as exc:
                family[system].error = describe_error(exc)
                log(f"w8 {system} @ {family[system].param}: FAILED: {family[system].error}")
                live.remove(system)
                break
            if cold:
                family[system].cold_s = seconds
            elif i >= _WARM:
                family[system].times_s.append(seconds)


TARGETS = ((1 * MIB, 2.0), (4 * MIB, 2.2), (16 * MIB, 3.0))  # issue 41
READ_ONCE_TARGET = (1 * MIB, 1.3)


def medium_targets(rows: Sequence[Row]) -> str:
    """Issue 41's targets as this run measured them: raydirect over the two bare
    calls at 1 MiB (at most 2.0x), 4 MiB (2.2x) and 16 MiB (3.0x), and with
    ``reads=1`` at 1 MiB (1.3x), beside the floor's own (the calls plus one
    copy, over the calls: what no system can beat); and at every size,
    raydirect over the object store (at most 1x) and over RDT gloo (under 1x:
    at most 0.99x as printed)."""
    median = {
        (r.system, r.x): statistics.median(r.times_s) for r in rows if r.times_s and r.error is None
    }
    lines: list[TargetLine] = []

    def ratio(a: str, b: str, x: float) -> float | None:
        return median[a, x] / median[b, x] if (a, x) in median and (b, x) in median else None

    def over_calls(system: str, what: str, nbytes: int, bound: float) -> None:
        calls = median.get((TWO_CALLS, nbytes))
        copy = median.get((FLOOR_ONE_COPY, nbytes))
        floor = (calls + copy) / calls if calls and copy is not None else None
        got = ratio(system, TWO_CALLS, nbytes)
        lines.append(TargetLine(what, bound, True, format_size(nbytes), got, floor))

    for nbytes, bound in TARGETS:
        over_calls(RAYDIRECT_AUTO, "raydirect auto / the two calls", nbytes, bound)
    over_calls(RAYDIRECT_READ_ONCE, "raydirect reads=1 / the two calls", *READ_ONCE_TARGET)
    for x in sorted({r.x for r in rows if r.workload == 8}):
        point = format_size(int(x))
        store = ratio(RAYDIRECT_AUTO, OBJECT_STORE, x)
        lines.append(TargetLine("raydirect auto / object store", 1.0, True, point, store, None))
        rdt = ratio(RAYDIRECT_AUTO, RDT_GLOO, x)
        lines.append(TargetLine("raydirect auto / RDT gloo", 0.99, True, point, rdt, None))
    return render_targets(
        lines, "Targets (ratios of median times in this run; the floor: the calls plus one copy):"
    )
