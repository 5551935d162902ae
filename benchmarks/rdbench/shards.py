"""Tensor-parallel shards of the benchmark's Llama-like state dict (workloads 6, 7).

Column-parallel weights (embedding, q/k/v, gate/up) are split by rows, dim 0;
row-parallel ones (o, down) by columns, dim 1 (a strided slice); norms are
replicated, as is any tensor whose split dimension does not divide evenly.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rdbench.common import DTYPE, ELEMENT_BYTES, Layout, fill_pattern, part_seed

_COLUMN_PARALLEL = ("embed_tokens", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")
_SAMPLES = 8  # elements of each checked tensor compared with the pattern
# Tensors checked per step, picked anew from the seed each step: checking all of
# 5,000 tensors would cost more than moving them, and the table would measure it.
_CHECKED_TENSORS = 64


# (name, global shape, rank, world) -> None (whole) or (dim, start, stop) of rank's slice
Split = Callable[[str, tuple[int, ...], int, int], "tuple[int, int, int] | None"]


def shard_of(
    name: str, shape: tuple[int, ...], rank: int, world: int
) -> tuple[int, int, int] | None:
    """``(dim, start, stop)`` of rank ``rank``'s slice of tensor ``name``, or None."""
    if any(k in name for k in _COLUMN_PARALLEL):
        dim = 0
    elif any(k in name for k in _ROW_PARALLEL) and len(shape) > 1:
        dim = 1
    else:
        return None
    if shape[dim] % world:
        return None
    part = shape[dim] // world
    return (dim, rank * part, (rank + 1) * part)


def rows_of(
    name: str, shape: tuple[int, ...], rank: int, world: int
) -> tuple[int, int, int] | None:
    """Workload 7's trainer ranks, as FSDP2 places them: rank ``rank``'s rows of
    every tensor (``Shard(0)``), or the whole tensor where they do not divide."""
    return _even(shape, 0, rank, world)


def columns_of(
    name: str, shape: tuple[int, ...], rank: int, world: int
) -> tuple[int, int, int] | None:
    """Workload 7's workers: rank ``rank``'s columns of every matrix (a strided
    slice of each row); vectors (norms) whole, as tensor parallelism keeps them."""
    return _even(shape, 1, rank, world) if len(shape) > 1 else None


def _even(shape: tuple[int, ...], dim: int, rank: int, world: int) -> tuple[int, int, int] | None:
    if shape[dim] % world:
        return None
    part = shape[dim] // world
    return (dim, rank * part, (rank + 1) * part)


class RankBlocks:
    """``shard_blocks`` for ``world`` ranks: every sharded weight stored as one
    block per rank (row-parallel ones as blocks of columns, column-parallel ones
    as blocks of rows), which the publisher lays out rank by rank: each rank's
    shard of every tensor is one stretch of the slot."""

    def __init__(self, world: int) -> None:
        self.world = world

    def __call__(self, name: str, shape: tuple[int, ...]) -> tuple[int, int] | None:
        spec = shard_of(name, shape, 0, self.world)
        return (spec[0], self.world) if spec is not None else None


def fill_rows(
    rows: dict[str, torch.Tensor], layout: Layout, seed: int, rank: int, world: int
) -> None:
    """Write rank ``rank``'s rows (``rows_of``) of every tensor in place, element i
    of tensor k's global tensor holding i + part_seed(seed, k) (as ``check_shards``
    reads it back from a worker's columns)."""
    for k, (name, local) in enumerate(rows.items()):
        spec = rows_of(name, layout[name], rank, world)
        first = 0 if spec is None else spec[1] * (local.numel() // max(1, local.shape[0]))
        fill_pattern(local, part_seed(seed, k) + first)


def sharded_shape(
    name: str, shape: tuple[int, ...], rank: int, world: int, split: Split = shard_of
) -> tuple[int, ...]:
    spec = split(name, shape, rank, world)
    if spec is None:
        return shape
    dim, start, stop = spec
    return (*shape[:dim], stop - start, *shape[dim + 1 :])


def check_shards(
    targets: dict[str, torch.Tensor],
    layout: Layout,
    seed: int,
    rank: int,
    world: int,
    split: Split = shard_of,
) -> int:
    """Compare sampled elements of ``_CHECKED_TENSORS`` targets (the first, the
    last and others picked by ``seed``), each rank ``rank``'s slice as ``split``
    says, with the pattern of the full tensor (element i of tensor k holds
    i + part_seed(seed, k)); return the bytes held."""
    names = list(layout)
    gen = torch.Generator().manual_seed(seed)
    picked = {
        0,
        len(names) - 1,
        *torch.randint(0, len(names), (_CHECKED_TENSORS,), generator=gen).tolist(),
    }
    for k in sorted(picked):
        name = names[k]
        spec = split(name, layout[name], rank, world) if world > 1 else None
        _check_one(targets[name], name, layout[name], part_seed(seed, k), spec, gen)
    return sum(t.numel() for t in targets.values()) * ELEMENT_BYTES


def _check_one(
    target: torch.Tensor,
    name: str,
    shape: tuple[int, ...],
    seed: int,
    spec: tuple[int, int, int] | None,
    gen: torch.Generator,
) -> None:
    n = target.numel()
    picks = torch.cat([torch.tensor([0, n - 1]), torch.randint(0, n, (_SAMPLES,), generator=gen)])
    index = list(torch.unravel_index(picks, tuple(target.shape)))
    if spec is not None:
        index[spec[0]] = index[spec[0]] + spec[1]
    flat = torch.zeros_like(picks)
    for dim, size in enumerate(shape):
        flat = flat * size + index[dim]
    if not torch.equal(target.reshape(-1)[picks], (flat + seed).to(DTYPE)):
        raise ValueError(f"{name} (slice {spec}): wrong contents for seed {seed}")


def shard_bytes(layout: Layout, rank: int, world: int, split: Split = shard_of) -> int:
    shapes = (sharded_shape(n, s, rank, world, split) for n, s in layout.items())
    return sum(math.prod(shape) for shape in shapes) * ELEMENT_BYTES
