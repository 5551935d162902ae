"""Workload 7: weight sync from a sharded trainer, N ranks holding rows to N
workers holding columns.

The question: how long does one weight-sync step take when the trainer is
sharded (every tensor ``Shard(0)`` over N ranks, as FSDP2 places it) and each
inference worker holds other slices (columns of every matrix, as tensor
parallelism splits a row-parallel weight; vectors whole), if every byte goes
straight from the rank that holds it to the worker that needs it, against
first gathering the whole model on rank 0 and publishing it from there? And
does each worker receive only its slice?

Rows, at N -> N for each N of ``--consumers`` from 2 up (2 -> 2 and 4 -> 4 by
default; a point the machine's memory cannot hold is skipped, saying so):

- resharding: every rank publishes its rows (``rd.WeightPublisher(rows,
  placement=...)``), every worker loads its columns from all of them
  (``sub.load([h0, ..., hN-1])``);
- gather then publish: ranks 1..N-1 return their rows (``@rd.method``), rank 0
  copies its own rows into a whole model and reads the others' straight into
  their places there (``rd.get(refs, into=...)``), publishes the whole, and
  every worker loads its columns from that one handle;
- all-gather then publish: every rank runs ``torch.distributed.all_gather_single``
  over gloo for each tensor (the trainer's own world), then rank 0 publishes
  the whole, as above;
- the floors (``reshard_floors``), in the driver on one thread: one copy of
  each worker's slice from the whole model; and for resharding and gather then
  publish with each layout, exactly the copies of that system's step, whose
  ratio is the floor of the target "resharding at most 0.6x of gather then
  publish" in the same run.

Resharding and gather then publish run with each way a publisher can lay a
version out, so that each pair compares like with like: ``depth=2`` (a snapshot
copy per version, the default), ``depth=2`` with ``shard_blocks`` (each matrix
stored as one block of columns per worker, so that a worker's columns are one
stretch of each slot instead of a short run per row), and ``depth=0`` (no copy:
the handle refers to the tensors themselves, which the trainer writes only once
no handle holds them). All-gather then publish runs with ``depth=2``.

Ranks and workers start with malloc's memory on huge pages
(``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, beside ``THP_MEM_ALLOC_ENABLE=1``),
as docs/weight-sync.md#small-tensors-on-huge-pages advises for a trainer's
small tensors: most of a rank's shards here are 0.1-1.4 MiB, below
torch's huge-page allocations, and the kernel pins each 4 KiB page of a
cross-memory read (measured at 2 -> 2 without it: a depth=0 load 154 ms
instead of 82, every row slower).

The rows of a point run interleaved, one step of each in turn, so that all
meet the same load on a shared machine (``_interleaved``). Per step, untimed:
every rank writes its rows in place (a new seed). Timed, from
the driver: from the first publish (or gather) call until every worker's load
has returned. Then, untimed, each worker's tensors are checked (sampled) and its
bytes received in the load (``rd.local_stats()``) compared with its slice. GB/s
counts the bytes of all workers' slices.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from rdbench.common import (
    GROUP_FLOORS,
    GROUP_RAYDIRECT,
    MALLOC_HUGE_PAGES,
    SETUP_TIMEOUT_S,
    THP_ENV,
    TRANSFER_TIMEOUT_S,
    Layout,
    Row,
    describe_error,
    format_size,
    layout_bytes,
    log,
    state_dict_layout,
)
from rdbench.fleet import Context, skip
from rdbench.report import TargetLine, render_targets
from rdbench.reshard_actors import TrainerRank, Worker
from rdbench.reshard_floors import FLOOR_GATHER, FLOOR_RESHARD, Floors, floor_rows, floor_step
from rdbench.shards import columns_of, shard_bytes

RESHARD = "raydirect resharding, sub.load([h0, ..., hN-1])"
GATHER_PUBLISH = "gather to rank 0 with raydirect, then publish"
ALL_GATHER_PUBLISH = "torch.distributed all-gather (gloo), then publish"
BLOCKS = "shard_blocks"  # the publishers store each matrix as one block per worker
LIVE = "depth=0"  # the publishers make no copy: a version is the tensors themselves
WORKER_BYTES = "worker bytes / slice"  # Row.measured: the most any worker received
FASTER, EXACT = 0.6, 1.05  # the targets: time against gather-then-publish; bytes
# What a point holds, in units of the state: rows (1), every rank's whole (N), two
# depth-2 publishers (copies and blocks) of the rows (4) and of rank 0's whole (4),
# the workers' slices (1) and their scratch (up to 1), the floors' tensors (7: Floors).
_MEMORY_STATES = 18
# How the publishers lay out a version: system suffix -> the actors' ``slots``.
_SLOTS = {"": "copy", f", {BLOCKS}": "blocks", f", {LIVE}": "live"}
# system -> (how the step runs, the publishers' slots): resharding and gather then
# publish with each layout, so that each pair compares like with like.
_SYSTEMS = {
    **{f"{RESHARD}{suffix}": ("reshard", slots) for suffix, slots in _SLOTS.items()},
    **{f"{GATHER_PUBLISH}{suffix}": ("gather", slots) for suffix, slots in _SLOTS.items()},
    ALL_GATHER_PUBLISH: ("all-gather", "copy"),
}


def _param(n: int) -> str:
    return f"{n} ranks -> {n} workers"


def reshard(ctx: Context) -> list[Row]:
    """Workload 7 (see the module docstring)."""
    cfg, rows = ctx.config, list[Row]()
    layout = state_dict_layout(cfg.state_bytes)
    versions = itertools.count(1)  # one sequence for every publisher and subscriber
    points = sorted({n for n in cfg.consumers if n >= 2})
    log(f"w7: {len(layout)} tensors, {format_size(cfg.state_bytes)}, points {points}")
    for n in points:
        delivered = sum(shard_bytes(layout, w, n, columns_of) for w in range(n))
        steps: list[_Timed] = []
        actors: list[Any] = []
        if cfg.wants(GROUP_RAYDIRECT):
            family = [Row(7, s, _param(n), n, delivered) for s in _SYSTEMS]
            rows += family
            missing = _memory_missing(layout, n)
            if missing:
                for row in family:
                    skip(row, missing)
            else:
                actors, timed = _start_point(family, layout, n, versions)
                steps += timed
        if cfg.wants(GROUP_FLOORS):
            floors = _floors(layout, n, delivered)
            steps += floors
            rows += [timed.row for timed in floors]
        _interleaved(steps, cfg.sync_steps, ctx.seed_iter)
        _stop(actors)
    return rows


@dataclass
class _Timed:
    """A row, its timed step, and each step's bytes received per worker (raydirect rows)."""

    row: Row
    step: Callable[[int], float]
    received: list[list[int]] = field(default_factory=list)
    slices: list[int] = field(default_factory=list)


def _interleaved(steps: list[_Timed], repeats: int, seed_iter: Iterator[int]) -> None:
    """Each row's cold step, then ``repeats`` rounds of one step of every row in turn.

    This machine is shared and its load drifts over minutes: run one after another,
    rows meet different loads (the shard_blocks pair at 4 -> 4 measured 0.98x in
    one run and 2.83x in the next), while rows interleaved step by step meet the
    same load, so the ratios between them hold. A failure ends its row only."""
    if not steps:
        return
    log(f"w7 @ {steps[0].row.param}: {len(steps)} rows interleaved, 1 cold + {repeats} steps each")
    for i in range(repeats + 1):
        for timed in steps:
            row = timed.row
            if row.error is not None:
                continue
            try:
                seconds = timed.step(next(seed_iter))
            except Exception as exc:  # report the row as n/a and go on with the others
                row.error = describe_error(exc)
                log(f"w7 {row.system} @ {row.param}: FAILED: {row.error}")
                continue
            if i == 0:
                row.cold_s = seconds
            else:
                row.times_s.append(seconds)
    for timed in steps:
        row = timed.row
        if timed.received and row.error is None:
            row.measured[WORKER_BYTES] = max(
                got / want
                for one in timed.received
                for got, want in zip(one, timed.slices, strict=True)
            )
        if row.error is None:
            log(f"w7 {row.system} @ {row.param}: median {row.median():.2f} {row.unit}")


def _floors(layout: Layout, n: int, delivered: int) -> list[_Timed]:
    """The floor rows of point ``n``, each a step of one system's copies in the
    driver (``reshard_floors``)."""
    floors = Floors(layout, n)
    if floors.slice_bytes() != delivered:
        raise ValueError("the floors would copy other bytes than the workers' slices")
    return [
        _Timed(row, floor_step(floors, system, slots))
        for row, system, slots in floor_rows(_param(n), n, delivered, _SLOTS.items())
    ]


def _memory_missing(layout: Layout, n: int) -> str | None:
    """Why this machine cannot hold point ``n``, or None."""
    need = (_MEMORY_STATES + n) * layout_bytes(layout)
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None  # no way to tell: try
    if need > 0.8 * available:
        return (
            f"{n} -> {n} needs about {format_size(need)} and {format_size(available)} is available"
        )
    return None


def _start_point(
    family: list[Row], layout: Layout, n: int, versions: Iterator[int]
) -> tuple[list[Any], list[_Timed]]:
    """N ranks in one gloo world and N workers, started and allocated; each row's
    step. On a failure the rows say why and there are no steps."""
    log(f"w7: starting {n} trainer ranks (one gloo world) and {n} workers")
    env = {"env_vars": {**THP_ENV, **MALLOC_HUGE_PAGES}}  # see the module docstring
    ranks = [TrainerRank.options(runtime_env=env).remote(r, n) for r in range(n)]
    workers = [Worker.options(runtime_env=env).remote(w, n) for w in range(n)]
    try:
        port = ray.get(ranks[0].open_store.remote(), timeout=SETUP_TIMEOUT_S)
        ray.get([r.join.remote(port) for r in ranks], timeout=SETUP_TIMEOUT_S)
        ray.get([r.allocate.remote(layout) for r in ranks], timeout=SETUP_TIMEOUT_S)
        slices = ray.get([w.allocate.remote(layout) for w in workers], timeout=SETUP_TIMEOUT_S)
    except Exception as exc:
        reason = f"w7 set-up failed: {describe_error(exc)}"
        log(reason)
        for row in family:
            row.error = reason
        return [*ranks, *workers], []
    timed = []
    for row in family:
        received: list[list[int]] = []
        step = _step(row.system, ranks, workers, slices, versions, received)
        timed.append(_Timed(row, step, received, slices))
    return [*ranks, *workers], timed


def _stop(actors: list[Any]) -> None:
    try:
        ray.get([a.release.remote() for a in actors], timeout=SETUP_TIMEOUT_S)
    except Exception as exc:
        log(f"w7: releasing the actors' tensors failed: {describe_error(exc)}")
    for actor in actors:
        ray.kill(actor)


def _step(
    system: str,
    ranks: list[Any],
    workers: list[Any],
    slices: list[int],
    versions: Iterator[int],
    received: list[list[int]],
) -> Callable[[int], float]:
    """One timed step of ``system``; appends each worker's bytes received to ``received``."""
    how, slots = _SYSTEMS[system]
    source = f"{'ranks' if how == 'reshard' else 'whole'}, {slots}"  # a subscriber for each

    def step(seed: int) -> float:
        ray.get([r.prepare.remote(seed) for r in ranks], timeout=SETUP_TIMEOUT_S)
        version = next(versions)
        start = time.perf_counter()
        others: list[Any] = []
        if how == "reshard":
            handles: Any = [r.publish.remote(version, slots) for r in ranks]
        elif how == "gather":
            refs = [r.rows_state.remote() for r in ranks[1:]]  # in a list: Ray passes refs
            handles = ranks[0].gather_publish.remote(refs, version, slots)
        else:
            handles, *others = [r.allgather_publish.remote(version, slots) for r in ranks]
        loads = [w.load.remote(source, handles) for w in workers]
        got = ray.get(loads, timeout=TRANSFER_TIMEOUT_S)
        seconds = time.perf_counter() - start
        ray.get(others, timeout=TRANSFER_TIMEOUT_S)  # done already: their gathers fed rank 0's
        received.append(got)
        held = ray.get([w.check.remote(seed) for w in workers], timeout=TRANSFER_TIMEOUT_S)
        if held != slices:
            raise ValueError(f"workers hold {held} bytes, expected {slices}")
        return seconds

    return step


# ---------------------------------------------------------------- targets

BYTES_TITLE = (
    "Targets (this run: times as ratios of median step times; bytes as the most any "
    "worker received in one load, by rd.local_stats(), over the bytes of its slice):"
)


def reshard_targets(rows: Sequence[Row]) -> str:
    """The issue's two targets at each point this run measured, for each way the
    publishers lay a version out: resharding at most 0.6x the time of gather then
    publish (laid out alike); each worker's bytes at most 1.05x its slice."""
    ms = {
        (r.system, r.param): statistics.median(r.times_s) * 1e3
        for r in rows
        if r.times_s and r.error is None
    }
    by_key = {(r.system, r.param): r for r in rows}
    lines: list[TargetLine] = []
    for point in dict.fromkeys(r.param for r in rows if r.system == RESHARD):
        for suffix, slots in _SLOTS.items():
            ours, theirs = f"{RESHARD}{suffix}", f"{GATHER_PUBLISH}{suffix}"
            how = {"copy": "depth=2", "blocks": f"depth=2, {BLOCKS}", "live": LIVE}[slots]
            what = f"resharding / gather then publish ({how})"
            got = _ratio(ms, (ours, point), (theirs, point))
            floor = _ratio(
                ms, (f"{FLOOR_RESHARD}{suffix}", point), (f"{FLOOR_GATHER}{suffix}", point)
            )
            lines.append(TargetLine(what, FASTER, True, point, got, floor))
            row = by_key.get((ours, point))
            worst = row.measured.get(WORKER_BYTES) if row and row.error is None else None
            what = f"each worker's bytes / its slice ({how})"
            lines.append(TargetLine(what, EXACT, True, point, worst, None))
    return render_targets(lines, BYTES_TITLE)


def _ratio(
    ms: dict[tuple[str, str], float], mine: tuple[str, str], base: tuple[str, str]
) -> float | None:
    a, b = ms.get(mine), ms.get(base)
    return a / b if a is not None and b else None
