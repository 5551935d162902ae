"""Workload 7's floors: the copies each system makes in a step, and nothing else.

Resharding and gather then publish differ in how many times each byte is
copied, not in how fast a copy runs: with ``depth=2`` resharding snapshots the
ranks' rows and each worker reads its slice (two copies a byte), gather then
publish first copies every rank's rows into rank 0's whole model (three);
``depth=0`` drops the snapshot from both (one against two). So the target
"resharding at most 0.6x of gather then publish" has a floor of its own on this
machine, which these rows measure in the same run: each runs exactly the copies
of one system's step, with its publishers' layout, one after another in the
driver on one thread, from tensors laid out as the ranks' and into tensors laid
out as the workers'. The ratio of the two floor rows of a layout is that
target's floor. (Resharding spreads its copies over N processes, which a floor
on one thread does not; on this machine two threads copy about 1.3x as fast as
one, so the floor flatters resharding little.)

- snapshot (``depth=2``): each rank's rows, or rank 0's whole, copied to a slot;
- ``shard_blocks``: the same, each matrix stored as one block of columns per worker;
- the workers' slices: each worker's columns of every matrix (vectors whole)
  copied from wherever the step's publisher holds them;
- the gather: every rank's rows copied into their place in one whole model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from rdbench.common import DTYPE, ELEMENT_BYTES, Layout, Row, fill_layout
from rdbench.shards import Split, check_shards, columns_of, fill_rows, rows_of, sharded_shape

FLOOR = "floor: in-process copy of each worker's slice"
FLOOR_RESHARD = "floor: resharding's copies"
FLOOR_GATHER = "floor: gather then publish's copies"
SLICES_ONLY = "slices"  # the layout of FLOOR: the workers' slices from the whole, nothing else

Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (destination, source) of each copy
Store = dict[str, torch.Tensor]


class Floors:
    """The tensors every floor row copies between, allocated and touched once:
    the ranks' rows, one whole model, the workers' slices, and a slot for each
    publisher's layout (each rank's and the whole's, plain and in blocks)."""

    def __init__(self, layout: Layout, n: int) -> None:
        self.layout, self.n = layout, n
        self.rows = [_zeros(layout, r, n, rows_of) for r in range(n)]
        self.whole = _zeros(layout, 0, 1, rows_of)
        self.targets = [_zeros(layout, w, n, columns_of) for w in range(n)]
        self._slots = {  # the whole's slots are a rank's of a world of one
            (who, blocks): [_slot(layout, r, world, blocks, n) for r in range(world)]
            for who, world in (("ranks", n), ("whole", 1))
            for blocks in (False, True)
        }

    def copies(self, system: str, slots: str) -> Pairs:
        """Every copy of one step of ``system`` ("reshard", "gather" or
        ``SLICES_ONLY``) with the publishers' ``slots`` ("copy", "blocks", "live")."""
        if system == SLICES_ONLY:
            return self._slices([self.whole], False)
        gather = system == "gather"
        held = [self.whole] if gather else self.rows  # what the publishers publish
        pairs = self._gather() if gather else []
        if slots == "live":
            return pairs + self._slices(held, False)
        blocks = slots == "blocks"
        stored = self._slots[("whole" if gather else "ranks", blocks)]
        for source, slot in zip(held, stored, strict=True):
            pairs += [(slot[k], _blocked(t, slot[k], blocks)) for k, t in source.items()]
        return pairs + self._slices(stored, blocks)

    def _gather(self) -> Pairs:
        pairs = []
        for r, rows in enumerate(self.rows):
            for name, local in rows.items():
                spec = rows_of(name, self.layout[name], r, self.n)
                if spec is not None:
                    pairs.append((self.whole[name][spec[1] : spec[2]], local))
                elif r == 0:  # held whole by every rank: rank 0's own
                    pairs.append((self.whole[name], local))
        return pairs

    def _slices(self, held: list[Store], blocks: bool) -> Pairs:
        """Each worker's slice from the publishers' ``held`` (one per rank, or the
        whole alone), each piece from the one rank that holds it (rank 0 for a
        tensor every rank holds whole)."""
        world = len(held)
        pairs = []
        for w, target in enumerate(self.targets):
            for name, dest in target.items():
                shape = self.layout[name]
                cols = columns_of(name, shape, w, self.n)
                for r, store in enumerate(held):
                    rows = rows_of(name, shape, r, world) if world > 1 else None
                    if rows is None and r:
                        continue
                    part = dest if rows is None else dest[rows[1] : rows[2]]
                    if blocks and _in_blocks(shape, self.n):
                        source = store[name][w]
                    else:
                        source = store[name] if cols is None else store[name][:, cols[1] : cols[2]]
                    pairs.append((part, source))
        return pairs

    def prepare(self, seed: int, system: str) -> None:
        """The trainer's step (untimed): every rank's rows written anew, or the
        whole model where ``system`` copies from it alone (a gather writes it)."""
        if system == SLICES_ONLY:
            fill_layout(self.whole, seed)
            return
        for r, rows in enumerate(self.rows):
            fill_rows(rows, self.layout, seed, r, self.n)

    def check(self, seed: int) -> None:
        for w, target in enumerate(self.targets):
            check_shards(target, self.layout, seed, w, self.n, columns_of)

    def slice_bytes(self) -> int:
        return sum(t.numel() for target in self.targets for t in target.values()) * ELEMENT_BYTES


def floor_step(floors: Floors, system: str, slots: str) -> Callable[[int], float]:
    """A timed step of ``system``'s copies: one thread (as in a Ray worker),
    checked after."""
    pairs = floors.copies(system, slots)

    def step(seed: int) -> float:
        floors.prepare(seed, system)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            start = time.perf_counter()
            for dest, source in pairs:
                dest.copy_(source)
            seconds = time.perf_counter() - start
        finally:
            torch.set_num_threads(threads)
        floors.check(seed)
        return seconds

    return step


def floor_rows(
    param: str, n: int, delivered: int, suffixes: Iterable[tuple[str, str]]
) -> list[tuple[Row, str, str]]:
    """The floor rows of a point: (row, system, slots) for the workers' slices
    alone, then for resharding and gather then publish with each layout
    (``suffixes``: the systems' suffix and the publishers' ``slots``)."""
    out = [(Row(7, FLOOR, param, n, delivered), SLICES_ONLY, "live")]
    for suffix, slots in suffixes:
        out.append((Row(7, f"{FLOOR_RESHARD}{suffix}", param, n, delivered), "reshard", slots))
        out.append((Row(7, f"{FLOOR_GATHER}{suffix}", param, n, delivered), "gather", slots))
    return out


def _in_blocks(shape: tuple[int, ...], n: int) -> bool:
    """Whether ``shard_blocks`` stores this tensor as blocks of columns (as the
    bench's publishers do: a matrix whose columns divide among the workers)."""
    return len(shape) > 1 and shape[1] % n == 0


def _blocked(source: torch.Tensor, slot: torch.Tensor, blocks: bool) -> torch.Tensor:
    """``source`` as the slot stores it: in blocks of columns, a view of it shaped
    as the slot (block b: columns b*k .. (b+1)*k), else as it is."""
    if not blocks or slot.dim() != 3:
        return source
    n, rows, k = slot.shape
    return source.view(rows, n, k).transpose(0, 1)


def _zeros(layout: Layout, rank: int, world: int, split: Split) -> Store:
    return {
        name: torch.zeros(sharded_shape(name, shape, rank, world, split), dtype=DTYPE)
        for name, shape in layout.items()
    }


def _slot(layout: Layout, rank: int, world: int, blocks: bool, n: int) -> Store:
    """A publisher's slot of rank ``rank`` of ``world`` (its rows): as the rows are,
    or with each matrix as ``n`` blocks of columns, block b one contiguous tensor."""
    slot = {}
    for name, shape in layout.items():
        local = sharded_shape(name, shape, rank, world, rows_of)
        if blocks and _in_blocks(local, n):
            slot[name] = torch.zeros((n, local[0], local[1] // n), dtype=DTYPE)
        else:
            slot[name] = torch.zeros(local, dtype=DTYPE)
    return slot
