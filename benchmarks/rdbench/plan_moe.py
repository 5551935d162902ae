"""Workload 12: how long does one worker's resharding plan take for a 1T-parameter
MoE, and how evenly do all workers' plans spread their reads over the trainer's ranks?

Plan only: no tensor memory, no byte moved. The layout is Kimi-K2-like (the
constants below): 61 layers, the first dense, 384 routed experts and one shared
expert per MoE layer, MLA attention, bf16 weights with an fp32 router and an fp32
``e_score_correction_bias`` per layer: about 70,000 tensors, 1.03T parameters.

Sources, 256 trainer ranks = expert parallel 16 x FSDP 16: routed experts are split
over the 16 EP groups (experts ``24g .. 24g+23`` in group g), each expert tensor
``Shard(0)`` over its group's 16 FSDP ranks; every other tensor ``Shard(0)`` over
all 256 ranks (FSDP2's uneven chunks: some ranks hold nothing of a small tensor),
except the bias, ``Replicate()``. Each rank lays its pieces back to back in one
buffer. Targets, 128 workers = TP 8 x EP 16 (worker = 8 * ep + tp): the routed
experts of the worker's EP group, gate/up ``Shard(0)`` and down ``Shard(1)`` over
TP; attention q/kv projections ``Shard(0)``, o_proj ``Shard(1)``; embedding and
lm_head ``Shard(0)`` (vocab parallel); norms, router and bias whole; the dense MLP
and the shared expert TP-sharded like the experts, in every EP group.

Rows: the source index (grouping and validating all ranks' boxes, once per
source layout), worker 0's plan, and every worker's targets built and planned
(``--plan-workers`` of them, 128 in a full run), each timed in this process
with no Ray; every plan is checked to move exactly its targets' bytes. The
summary gives the layout, worker 0's plan rows and bytes per source rank summed
over every worker's plan (max/mean), against the targets (plan <= 1 s,
max/mean <= 1.1).

    ./dev raydirect bench --workloads 12 [--plan-workers 128] [--repeats 5]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from raydirect._boxes import Sources, Targets, Tensors, dtensor_boxes, pack
from raydirect._plan import SourceIndex, index_sources, plan
from rdbench.common import GROUP_RAYDIRECT, Row, describe_error, log
from rdbench.fleet import Context
from rdbench.report import TargetLine, render_targets

LAYERS, DENSE_LAYERS = 61, 1
HIDDEN, VOCAB = 7168, 163840
EXPERTS, MOE_INTERMEDIATE, DENSE_INTERMEDIATE = 384, 2048, 18432
Q_LORA, KV_LORA, HEADS, QK_NOPE, QK_ROPE, V_HEAD = 1536, 512, 64, 128, 64, 128
EP, FSDP, TP = 16, 16, 8  # trainer: EP x FSDP ranks; workers: EP x TP
BF16, FP32 = 2, 4
PLAN_SECONDS, BALANCE = 1.0, 1.1  # the targets
WORKER = 0  # the worker whose plan is timed on its own
T = TypeVar("T")


@dataclass(frozen=True)
class Kind:
    """Tensors of one shape and placement: ``source`` is "fsdp" (Shard(0) over all
    ranks), "ep" (Shard(0) over the FSDP ranks of one EP group) or "replicate";
    ``target`` is a TP shard dim or None (whole)."""

    name: str
    shape: tuple[int, ...]
    itemsize: int
    source: str
    target: int | None
    count: int
    experts: bool = (
        False  # tensor i of the kind belongs to EP group (i % EXPERTS) // (EXPERTS // EP)
    )


def kinds() -> list[Kind]:
    moe, every = LAYERS - DENSE_LAYERS, LAYERS
    qk = QK_NOPE + QK_ROPE
    return [
        Kind("input_layernorm", (HIDDEN,), BF16, "fsdp", None, every),
        Kind("post_attention_layernorm", (HIDDEN,), BF16, "fsdp", None, every),
        Kind("q_a_proj", (Q_LORA, HIDDEN), BF16, "fsdp", 0, every),
        Kind("q_a_layernorm", (Q_LORA,), BF16, "fsdp", None, every),
        Kind("q_b_proj", (HEADS * qk, Q_LORA), BF16, "fsdp", 0, every),
        Kind("kv_a_proj_with_mqa", (KV_LORA + QK_ROPE, HIDDEN), BF16, "fsdp", 0, every),
        Kind("kv_a_layernorm", (KV_LORA,), BF16, "fsdp", None, every),
        Kind("kv_b_proj", (HEADS * (QK_NOPE + V_HEAD), KV_LORA), BF16, "fsdp", 0, every),
        Kind("o_proj", (HIDDEN, HEADS * V_HEAD), BF16, "fsdp", 1, every),
        Kind("dense.gate_proj", (DENSE_INTERMEDIATE, HIDDEN), BF16, "fsdp", 0, DENSE_LAYERS),
        Kind("dense.up_proj", (DENSE_INTERMEDIATE, HIDDEN), BF16, "fsdp", 0, DENSE_LAYERS),
        Kind("dense.down_proj", (HIDDEN, DENSE_INTERMEDIATE), BF16, "fsdp", 1, DENSE_LAYERS),
        Kind("gate.weight", (EXPERTS, HIDDEN), FP32, "fsdp", None, moe),
        Kind("gate.e_score_correction_bias", (EXPERTS,), FP32, "replicate", None, moe),
        Kind("experts.gate_proj", (MOE_INTERMEDIATE, HIDDEN), BF16, "ep", 0, moe * EXPERTS, True),
        Kind("experts.up_proj", (MOE_INTERMEDIATE, HIDDEN), BF16, "ep", 0, moe * EXPERTS, True),
        Kind("experts.down_proj", (HIDDEN, MOE_INTERMEDIATE), BF16, "ep", 1, moe * EXPERTS, True),
        Kind("shared_experts.gate_proj", (MOE_INTERMEDIATE, HIDDEN), BF16, "fsdp", 0, moe),
        Kind("shared_experts.up_proj", (MOE_INTERMEDIATE, HIDDEN), BF16, "fsdp", 0, moe),
        Kind("shared_experts.down_proj", (HIDDEN, MOE_INTERMEDIATE), BF16, "fsdp", 1, moe),
        Kind("embed_tokens", (VOCAB, HIDDEN), BF16, "fsdp", 0, 1),
        Kind("norm", (HIDDEN,), BF16, "fsdp", None, 1),
        Kind("lm_head", (VOCAB, HIDDEN), BF16, "fsdp", 0, 1),
    ]


NDIM = 2


def padded(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (1,) * (NDIM - len(shape)) + shape


class Layout:
    """The tensors (numbered kind by kind), each one's EP group (-1: every group),
    and the trainer's pieces."""

    def __init__(self) -> None:
        self.kinds = kinds()
        counts = np.array([k.count for k in self.kinds])
        self.first = np.r_[0, np.cumsum(counts)]  # kind j's tensors: first[j]..first[j+1]-1
        self.kind = np.repeat(np.arange(len(self.kinds)), counts)
        per_group = EXPERTS // EP
        self.group = np.full(len(self.kind), -1)
        for j, k in enumerate(self.kinds):
            if k.experts:
                self.group[self.first[j] : self.first[j + 1]] = (
                    np.arange(k.count) % EXPERTS // per_group
                )
        shapes = np.array([padded(k.shape) for k in self.kinds])
        self.tensors = Tensors(
            itemsize=np.array([k.itemsize for k in self.kinds])[self.kind],
            global_shape=shapes[self.kind],
        )
        self.sources = self._sources()

    def _sources(self) -> Sources:
        parts: list[tuple[np.ndarray, ...]] = []
        for j, k in enumerate(self.kinds):
            ids = np.arange(self.first[j], self.first[j + 1])
            if k.source == "ep":
                start, shape = dtensor_boxes(
                    padded(k.shape), (FSDP,), [("shard", NDIM - len(k.shape))]
                )
                ranks = self.group[ids][:, None] * FSDP + np.arange(FSDP)  # (tensors, FSDP)
            else:
                placement = ("shard", NDIM - len(k.shape)) if k.source == "fsdp" else ("replicate",)
                start, shape = dtensor_boxes(padded(k.shape), (EP * FSDP,), [placement])
                ranks = np.broadcast_to(np.arange(EP * FSDP), (len(ids), EP * FSDP))
            n = ranks.shape[1]
            parts.append(
                (
                    np.repeat(ids, n),
                    ranks.reshape(-1),
                    np.tile(start, (len(ids), 1)),
                    np.tile(shape, (len(ids), 1)),
                )
            )
        tensor, rank, start, shape = (np.concatenate(c) for c in zip(*parts, strict=True))
        nbytes = shape.prod(1) * self.tensors.itemsize[tensor]
        return Sources(
            tensor=tensor,
            rank=rank,
            start=start,
            shape=shape,
            index=np.zeros_like(rank),
            base=pack(rank, nbytes),
        )

    def targets(self, worker: int) -> Targets:
        """Worker ``worker``'s pieces: one destination per tensor, numbered as the tensor."""
        ep, tp = divmod(worker, TP)
        parts: list[tuple[np.ndarray, ...]] = []
        for j, k in enumerate(self.kinds):
            ids = np.arange(self.first[j], self.first[j + 1])
            ids = ids[(self.group[ids] == -1) | (self.group[ids] == ep)]
            placement = (
                ("replicate",) if k.target is None else ("shard", NDIM - len(k.shape) + k.target)
            )
            start, shape = dtensor_boxes(padded(k.shape), (TP,), [placement], coords=[[tp]])
            parts.append((ids, np.repeat(start, len(ids), 0), np.repeat(shape, len(ids), 0)))
        tensor, start, shape = (np.concatenate(c) for c in zip(*parts, strict=True))
        return Targets(
            tensor=tensor, start=start, shape=shape, dest=tensor, dest_base=np.zeros_like(tensor)
        )


INDEX = "source index (group + validate all ranks' boxes)"
ONE_PLAN = f"worker {WORKER}'s plan"
EVERY_PLAN = "every worker's targets built and planned"
SPREAD = "bytes per source rank, max/mean"
SPREAD_REPLICATED = "replicated tensors' bytes per owner, max/mean"


def plan_moe(ctx: Context) -> list[Row]:
    """Workload 12: the index and worker 0's plan ``repeats`` times after a cold
    one, then every worker's plan once (the module's docstring). In this
    process, no Ray: the planner is a pure module."""
    cfg = ctx.config
    workers = min(cfg.plan_workers, EP * TP)
    point = f"{EP * FSDP} ranks -> {workers} workers"
    rows = [Row(12, s, point, workers, 0, unit="us") for s in (INDEX, ONE_PLAN, EVERY_PLAN)]
    if not cfg.wants(GROUP_RAYDIRECT):
        return []
    try:
        _measure(rows, workers, cfg.repeats(0))
    except Exception as exc:  # a planner that refuses the layout is a finding
        for row in rows:
            row.error = row.error or describe_error(exc)
        log(f"w12: FAILED: {describe_error(exc)}")
    return rows


def _measure(rows: list[Row], workers: int, repeats: int) -> None:
    """Fill the index's, one plan's and every plan's rows (``plan_moe``)."""
    index_row, one_row, every_row = rows
    started = time.perf_counter()
    layout = Layout()
    log(f"w12: {len(layout.kind):,} tensors laid out in {time.perf_counter() - started:.2f} s")
    index = _timed(index_row, repeats, lambda: index_sources(layout.tensors, layout.sources))
    if index.problems:
        raise ValueError(f"the source boxes do not tile: {list(index.problems.items())[:3]}")
    targets = layout.targets(WORKER)
    one = _timed(one_row, repeats, lambda: plan(index, targets, WORKER))
    one_row.note = f"{len(one):,} rows, {one.nbytes / 2**30:.2f} GiB from {len(one.ranks)} ranks"
    # Twice, not ``repeats`` times: a pass is seconds, and the plans of one worker
    # are timed on their own above; the second pass is the warm one.
    per_rank, per_owner = _timed(every_row, 1, lambda: _every_plan(layout, index, workers))
    every_row.measured[SPREAD] = _balance(per_rank)
    every_row.measured[SPREAD_REPLICATED] = _balance(per_owner)
    every_row.note = f"{per_rank.sum() / 2**40:.3f} TiB read"
    log(f"w12 {EVERY_PLAN}: {SPREAD} {_balance(per_rank):.3f}")


def _timed(row: Row, repeats: int, fn: Callable[[], T]) -> T:
    """One cold call of ``fn`` and ``repeats`` timed ones into ``row``; the last result."""
    for i in range(repeats + 1):
        started = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - started
        if i == 0:
            row.cold_s = seconds
        else:
            row.times_s.append(seconds)
    log(f"w12 {row.system}: median {row.median():.0f} us")
    return out


def _every_plan(layout: Layout, index: SourceIndex, workers: int) -> tuple[np.ndarray, np.ndarray]:
    """Bytes per source rank over the first ``workers`` workers' plans, and the
    same for the replicated tensors alone (whose reads the planner spreads over
    their owners). Each plan must move exactly its targets' bytes, none twice."""
    replicated = np.array([k.source == "replicate" for k in layout.kinds])[layout.kind]
    per_rank, per_owner = np.zeros((2, EP * FSDP), np.int64)
    for worker in range(workers):
        wanted = layout.targets(worker)
        p = plan(index, wanted, worker)
        expected = int((wanted.shape.prod(1) * layout.tensors.itemsize[wanted.tensor]).sum())
        if p.nbytes != expected:
            raise ValueError(f"worker {worker}'s plan moves {p.nbytes} bytes, not {expected}")
        per_rank += p.bytes_per_rank(EP * FSDP)
        mine = replicated[p.dest]  # dest ids are tensor numbers here
        counts = np.bincount(p.rank[mine], p.length[mine] * p.count[mine], EP * FSDP)
        per_owner += counts.astype(np.int64)
    return per_rank, per_owner


def _balance(per_rank: np.ndarray) -> float:
    return float(per_rank.max() / per_rank.mean())


def plan_targets(rows: Sequence[Row]) -> str:
    """The two targets as this run measured them: worker 0's median plan time over
    1 s (at most 1x) and bytes per source rank over every plan's, max/mean (at
    most 1.1x; what FSDP2's uneven chunks leave is the layout's own)."""
    lines = []
    for row in rows:
        if row.error is not None or row.skipped is not None:
            continue
        if row.system == ONE_PLAN and row.times_s:
            seconds = statistics.median(row.times_s)
            what = f"worker {WORKER}'s plan time / {PLAN_SECONDS:g} s"
            lines.append(TargetLine(what, 1.0, True, row.param, seconds / PLAN_SECONDS, None))
        if SPREAD in row.measured:
            spread = row.measured[SPREAD]
            lines.append(TargetLine(SPREAD, BALANCE, True, row.param, spread, None))
    title = "Targets (no floor: the plan moves no byte):"
    layout = f"Layout: {_describe()}."
    table = render_targets(lines, title)
    return f"{layout}\n\n{table}" if table else layout


def _describe() -> str:
    """The layout in one line, from the constants alone (no arrays built)."""
    tensors = sum(k.count for k in kinds())
    params = sum(k.count * int(np.prod(k.shape)) for k in kinds())
    return (
        f"{tensors:,} tensors, {params / 1e12:.3f}T parameters, {EP * FSDP} trainer ranks "
        f"(EP {EP} x FSDP {FSDP}) to {EP * TP} workers (TP {TP} x EP {EP})"
    )
