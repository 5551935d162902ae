"""How long does one worker's resharding plan take for a 1T-parameter MoE, and how
evenly do all workers' plans spread their reads over the trainer's ranks?

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

Printed: the layout's size; the source index (grouping and validating all ranks'
boxes, once per source layout) and one worker's plan, medians of ``--repeats``
runs; that worker's plan rows; and bytes per source rank summed over every
worker's plan (max/mean), against the targets (plan <= 1 s, max/mean <= 1.1).

    ./dev python benchmarks/plan_moe.py [--repeats 5] [--worker 0] [--workers 128]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from raydirect._boxes import Sources, Targets, Tensors, dtensor_boxes, pack
from raydirect._plan import index_sources, plan

LAYERS, DENSE_LAYERS = 61, 1
HIDDEN, VOCAB = 7168, 163840
EXPERTS, MOE_INTERMEDIATE, DENSE_INTERMEDIATE = 384, 2048, 18432
Q_LORA, KV_LORA, HEADS, QK_NOPE, QK_ROPE, V_HEAD = 1536, 512, 64, 128, 64, 128
EP, FSDP, TP = 16, 16, 8  # trainer: EP x FSDP ranks; workers: EP x TP
BF16, FP32 = 2, 4
PLAN_SECONDS, BALANCE = 1.0, 1.1  # the targets
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


def timed(fn: Callable[[], T], repeats: int) -> tuple[float, T]:
    """The median time of ``repeats`` calls, and the last result."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def balance(per_rank: np.ndarray) -> float:
    return float(per_rank.max() / per_rank.mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per median")
    parser.add_argument("--worker", type=int, default=0, help="the worker whose plan is timed")
    parser.add_argument(
        "--workers", type=int, default=EP * TP, help="workers summed for the balance"
    )
    args = parser.parse_args()

    t0 = time.perf_counter()
    layout = Layout()
    built = time.perf_counter() - t0
    params = int(layout.tensors.global_shape.prod(1).sum())
    print(
        f"layout: {len(layout.kind):,} tensors, {params / 1e12:.3f}T parameters, "
        f"{len(layout.sources.tensor):,} source pieces on {EP * FSDP} ranks "
        f"(built in {built:.2f} s)"
    )

    repeats = max(1, args.repeats // 2)
    index_s, index = timed(lambda: index_sources(layout.tensors, layout.sources), repeats)
    assert not index.problems, list(index.problems.items())[:3]
    print(
        f"source index (group + validate, once per source layout): {index_s:.3f} s, "
        f"median of {repeats}"
    )

    targets = layout.targets(args.worker)
    plan_s, one = timed(lambda: plan(index, targets, args.worker), args.repeats)
    print(
        f"worker {args.worker}: {len(targets.tensor):,} target pieces, plan {plan_s * 1e3:.0f} ms "
        f"(median of {args.repeats}), {len(one):,} rows, {one.nbytes / 2**30:.2f} GiB "
        f"from {len(one.ranks)} ranks"
    )

    # Every worker's plan, summed per source rank; the replicated tensors apart.
    replicated = np.array([k.source == "replicate" for k in layout.kinds])[layout.kind]
    per_rank, per_owner = np.zeros((2, EP * FSDP), np.int64)
    t0 = time.perf_counter()
    for worker in range(args.workers):
        wanted = layout.targets(worker)
        p = plan(index, wanted, worker)
        # Exactly the targets' bytes move, none twice: the plan's own check here.
        assert p.nbytes == int(
            (wanted.shape.prod(1) * layout.tensors.itemsize[wanted.tensor]).sum()
        )
        per_rank += p.bytes_per_rank(EP * FSDP)
        mine = replicated[p.dest]  # dest ids are tensor numbers here
        per_owner += np.bincount(p.rank[mine], p.length[mine] * p.count[mine], EP * FSDP).astype(
            np.int64
        )
    spent = time.perf_counter() - t0
    ratio = balance(per_rank)
    print(
        f"{args.workers} workers' targets built and planned in {spent:.1f} s: "
        f"{per_rank.sum() / 2**40:.3f} TiB read, per source rank max/mean {ratio:.3f} "
        f"(min {per_rank.min() / 2**30:.2f} GiB, max {per_rank.max() / 2**30:.2f} GiB)"
    )
    print(
        f"replicated tensors ({int(replicated.sum())}, on all {EP * FSDP} ranks): "
        f"{per_owner.sum() / 2**20:.1f} MiB read from {int((per_owner > 0).sum())} ranks, "
        f"max/mean {balance(per_owner):.3f}"
    )
    print(
        f"targets: plan <= {PLAN_SECONDS:g} s: {'met' if plan_s <= PLAN_SECONDS else 'MISSED'} "
        f"({plan_s:.3f} s); max/mean <= {BALANCE:g}: {'met' if ratio <= BALANCE else 'MISSED'} "
        f"({ratio:.3f})"
    )


if __name__ == "__main__":
    main()
