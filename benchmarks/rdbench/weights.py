"""Workload 6: weight sync through raydirect's weight API, against the same job
done the way users write it with Ray's object store and Ray's RDT.

The question: how long does one weight-sync step take (a trainer's state to N
inference actors, whole or 4-way tensor-parallel sharded), as 200 tensors and
as 5,000 tensors of the same total size?
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
    OBJECT_STORE,
    RDT_GLOO,
    SETUP_TIMEOUT_S,
    TRANSFER_TIMEOUT_S,
    Layout,
    Row,
    fill_layout,
    format_size,
    layout_bytes,
    log,
    run_row,
    state_dict_layout,
)
from rdbench.fleet import Context, allocate, rdt_ready
from rdbench.report import TargetLine, render_targets
from rdbench.shards import shard_bytes, sharded_shape

LAYERS = {200: 22, 5000: 555}  # tensors -> decoder layers (9 tensors each, plus 2)
ONE_TENSOR = "model.embed_tokens.weight"  # the same bytes as one tensor: the baseline
WORLD = 4  # tensor-parallel ranks of the sharded rows
WEIGHT_API = "raydirect WeightPublisher"
LOAD_ONLY = "loads only"  # publish untimed: what each consumer's load costs
BLOCKS = "shard_blocks"  # each rank's block of every sharded weight, rank by rank
FLOOR_COPY = "floor: in-process copy"
# The same job with raydirect's primitives: the trainer's @rd.method returns its
# dict, each consumer reads it with rd.get(ref, into=its own tensors).
PRIMITIVES = "raydirect @rd.method dict, rd.get(into=)"


def _param(tensors: int, consumers: int) -> str:
    return f"{tensors} tensor{'s' * (tensors > 1)}, {_consumers(consumers)}"


def _consumers(n: int) -> str:
    return f"{n} consumer{'s' * (n > 1)}"


def weight_api(ctx: Context) -> list[Row]:
    """Per step, untimed: the trainer writes every tensor in place (a new seed).
    Timed, from the driver: ``publish`` and every consumer's load into its own
    tensors, checked, until the last is done. GB/s counts the bytes each consumer
    holds (the whole state, or its shard) times consumers."""
    cfg, rows = ctx.config, list[Row]()
    for tensors, layout in _layouts(cfg.state_bytes).items():
        log(f"w6: {len(layout)} tensors, {format_size(cfg.state_bytes)}")
        for world in (1, WORLD):
            shape = "full" if world == 1 else f"{world}-way sharded"
            if cfg.wants(GROUP_RAYDIRECT):
                rows += _family(ctx, f"{WEIGHT_API}, {shape}", tensors, layout, world, rdt=None)
                rows += _family(
                    ctx, f"{WEIGHT_API}, {shape}, {LOAD_ONLY}", tensors, layout, world, rdt=None
                )
                if world == 1:
                    rows += _family(ctx, PRIMITIVES, tensors, layout, world, rdt=None)
                if world > 1 and tensors > 1:  # the publisher told the shards: RankBlocks
                    for system in (
                        f"{WEIGHT_API}, {shape}, {BLOCKS}",
                        f"{WEIGHT_API}, {shape}, {BLOCKS}, {LOAD_ONLY}",
                    ):
                        rows += _family(ctx, system, tensors, layout, world, rdt=None, blocks=world)
            if cfg.wants(GROUP_RAY):
                rows += _family(ctx, _name(OBJECT_STORE, world), tensors, layout, world, rdt=False)
            if cfg.wants(GROUP_RDT):
                rows += _family(ctx, _name(RDT_GLOO, world), tensors, layout, world, rdt=True)
        if cfg.wants(GROUP_FLOORS):
            rows += [_floor(ctx, tensors, layout, world) for world in (1, WORLD)]
    ctx.release()
    return rows


def _layouts(nbytes: int) -> dict[int, Layout]:
    """The same bytes as 1 tensor (split by rows when sharded), 200 and 5,000."""
    layouts: dict[int, Layout] = {1: {ONE_TENSOR: (nbytes // ELEMENT_BYTES // 1024, 1024)}}
    for tensors, layers in LAYERS.items():
        try:
            layouts[tensors] = state_dict_layout(nbytes, layers=layers)
        except ValueError as exc:  # too small a state for that many layers (tests' sizes)
            log(f"w6: no {tensors}-tensor rows: {exc}")
    return layouts


def _name(system: str, world: int) -> str:
    return system if world == 1 else f"{system}, {world}-way sharded copy"


def _family(
    ctx: Context,
    system: str,
    tensors: int,
    layout: Layout,
    world: int,
    rdt: bool | None,
    blocks: int = 1,
) -> list[Row]:
    cfg = ctx.config
    counts = [n for n in cfg.consumers if world == 1 or n <= WORLD]
    family = [
        Row(6, system, _param(tensors, n), tensors * 10 + n, _delivered(layout, n, world))
        for n in counts
    ]
    if rdt:
        actors = rdt_ready(ctx, family)
        if actors is None:
            return family
        producer, consumers = actors
    else:
        producer, consumers = ctx.producers(1)[0], ctx.consumers(max(cfg.consumers))
    if not allocate([producer], layout, family):
        return family
    for row, n in zip(family, counts, strict=True):
        how = "by hand" if rdt is not None else "primitives" if system == PRIMITIVES else "publish"
        step = _step(producer, consumers[:n], layout, world, how, LOAD_ONLY in system, blocks)
        run_row(row, cfg.sync_steps, step, ctx.seed_iter)
    return family


def _delivered(layout: Layout, consumers: int, world: int) -> int:
    if world == 1:
        return layout_bytes(layout) * consumers
    return sum(shard_bytes(layout, r % world, world) for r in range(consumers))


def _step(
    producer: Any,
    consumers: list[Any],
    layout: Layout,
    world: int,
    how: str,
    loads_only: bool = False,
    blocks: int = 1,
) -> Callable[[int], float]:
    """One timed step: ``how`` is "publish" (the weight API), "primitives"
    (``PRIMITIVES``) or "by hand" (the object store's or RDT's dict, copied)."""
    key = f"{len(layout)}-{world}"
    ray.get([c.remember_layout.remote(key, layout) for c in consumers], timeout=SETUP_TIMEOUT_S)

    def step(seed: int) -> float:
        ray.get(producer.prepare.remote(seed), timeout=SETUP_TIMEOUT_S)  # the trainer's step
        if loads_only:
            ref = producer.publish.remote(blocks)
            ray.wait([ref], timeout=TRANSFER_TIMEOUT_S)
        start = time.perf_counter()
        if how == "publish":
            if not loads_only:
                ref = producer.publish.remote(blocks)
            loads = [
                c.load_weights.remote(ref, key, i % world, world) for i, c in enumerate(consumers)
            ]
        elif how == "primitives":
            ref = producer.state_auto.remote()
            loads = [c.get_state_into.remote([ref], key) for c in consumers]
        else:
            ref = producer.state.remote()
            loads = [
                c.copy_state.remote(ref, key, i % world, world) for i, c in enumerate(consumers)
            ]
        ray.get(loads, timeout=TRANSFER_TIMEOUT_S)
        seconds = time.perf_counter() - start
        checks = [
            c.check_targets.remote(seed, key, i % world, world) for i, c in enumerate(consumers)
        ]
        got = ray.get(checks, timeout=TRANSFER_TIMEOUT_S)
        want = [
            _delivered(layout, 1, 1) if world == 1 else shard_bytes(layout, i % world, world)
            for i in range(len(consumers))
        ]
        if got != want:
            raise ValueError(f"consumers hold {got} bytes, expected {want}")
        return seconds

    return step


def _floor(ctx: Context, tensors: int, layout: Layout, world: int) -> Row:
    """One in-process copy of the same tensors into preallocated ones (one thread,
    as in a Ray worker); sharded: of rank 0's slice of each tensor, from a
    contiguous block (as ``shard_blocks`` lays it out) into a tensor of its own."""
    system = FLOOR_COPY if world == 1 else f"{FLOOR_COPY}, {world}-way sharded"
    row = Row(6, system, _param(tensors, 1), tensors * 10 + 1, _delivered(layout, 1, world))
    shapes = {n: sharded_shape(n, s, 0, world) for n, s in layout.items()}
    source = {n: torch.empty(s, dtype=DTYPE) for n, s in shapes.items()}
    target = {n: torch.zeros(s, dtype=DTYPE) for n, s in shapes.items()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def copy(seed: int) -> float:
        fill_layout(source, seed)
        start = time.perf_counter()
        for name, tensor in source.items():
            target[name].copy_(tensor)
        seconds = time.perf_counter() - start
        if not all(torch.equal(target[n], source[n]) for n in (next(iter(layout)),)):
            raise ValueError("the floor's copy differs")
        return seconds

    try:
        return run_row(row, ctx.config.sync_steps, copy, ctx.seed_iter)
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------- targets

_SHARDED_LOADS = f"{WEIGHT_API}, {WORLD}-way sharded, {BLOCKS}, {LOAD_ONLY}"
_WHOLE_LOADS = f"{WEIGHT_API}, full, {LOAD_ONLY}"


def weight_targets(rows: Sequence[Row]) -> str:
    """The issue's three speed targets as this run measured them, each beside what
    the in-process copy (the floor) gives for the same ratio in the same run:
    where the floor itself misses a target, so must anything that lands the bytes
    in the consumer's own tensors."""
    ms = {
        (r.system, r.param): statistics.median(r.times_s) * 1e3
        for r in rows
        if r.times_s and r.error is None
    }
    lines: list[TargetLine] = []

    def ratio(a: tuple[str, str], b: tuple[str, str]) -> float | None:
        return ms[a] / ms[b] if a in ms and b in ms else None

    floor = ratio((FLOOR_COPY, _param(5000, 1)), (FLOOR_COPY, _param(1, 1)))
    for system, what in (
        (f"{WEIGHT_API}, full", "weight API, whole step"),
        (_WHOLE_LOADS, "weight API, loads"),
        (PRIMITIVES, "@rd.method dict, rd.get(into=)"),
    ):
        for n in (1, WORLD):
            got = ratio((system, _param(5000, n)), (system, _param(1, n)))
            point = f"{what}, {_consumers(n)}"
            lines.append(TargetLine("5,000 tensors / 1 tensor", 1.3, True, point, got, floor))
    for tensors in (200, 5000):
        point = _param(tensors, WORLD)
        got = ratio((RDT_GLOO, point), (f"{WEIGHT_API}, full", point))
        lines.append(TargetLine(f"{WORLD} consumers, RDT gloo / ours", 4, False, point, got, None))
    for tensors in (200, 5000):
        floor = ratio(
            (f"{FLOOR_COPY}, {WORLD}-way sharded", _param(tensors, 1)),
            (FLOOR_COPY, _param(tensors, 1)),
        )
        for n in (1, WORLD):
            point = _param(tensors, n)
            got = ratio((_SHARDED_LOADS, point), (_WHOLE_LOADS, point))
            lines.append(
                TargetLine(f"{WORLD}-way shard / whole load", 0.35, True, point, got, floor)
            )
    return render_targets(lines)
