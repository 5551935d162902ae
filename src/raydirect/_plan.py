"""The resharding planner: which bytes of which source rank land where in a worker.

Boxes in, runs out, as numpy columns (``_boxes``): no Ray, no torch, no Python
object per box. ``index_sources(tensors, sources)`` groups the ranks' identical
boxes into regions, each with the ranks that hold it, and validates the layout:
once per source layout, reused for every worker. ``plan(index, targets, worker)``
intersects one worker's ``Targets`` with the regions and returns a ``Plan``: the
fewest strided runs that fill every target byte once, each read from one owner,
grouped by rank, with byte totals. ``check`` returns the problems ``plan`` raises.

Overlaps are found without comparing pairs. A tensor's source boxes cut each dim at
their edges; the cuts make a grid of cells, each covered by exactly one region in a
valid layout (a DTensor layout is such a grid, one cell per box). A box is a range
of cells per dim (``np.searchsorted``), and a target's regions are its cells'.
Layouts that are no grid (a box spanning several cells) take the same path with
more cells: the cost follows the number of cells the boxes span.

How others do it, and what we do differently: torchstore intersects slices key by
key in Python, and its direct weight sync reads a whole source shard when the
overlap is partial, and replicated regions from their first holder; AReaL/Awex's
``TransferPlanBuilder`` loops over every pair of shards of every parameter; vLLM's
``sharded_rdt`` learns what a worker reads by running its loader on placeholders,
with no per-tensor sharding metadata. Here a plan is array arithmetic over all boxes
at once, only intersections move, as the longest runs both layouts allow, and each
replicated piece is read once, a replica set's owners sharing its bytes in equal
parts, rotated by the worker.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from raydirect import _boxes as boxes
from raydirect._boxes import I64, Problems, Sources, Targets, Tensors


class LayoutError(ValueError):
    """A layout that cannot be planned. ``problems`` maps tensor numbers to messages,
    so that the caller can name the tensors, before any byte moves."""

    def __init__(self, problems: Problems) -> None:
        self.problems = problems
        shown = ". ".join(f"tensor {t}: {'; '.join(m)}" for t, m in sorted(problems.items())[:5])
        more = f" (and {len(problems) - 5} more tensors)" if len(problems) > 5 else ""
        super().__init__(shown + more)


def _expand(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(item, k) for each item repeated ``counts[item]`` times, k = 0..count-1."""
    item = np.repeat(np.arange(len(counts)), counts)
    return item, np.arange(len(item)) - (np.cumsum(counts) - counts)[item]


def _splitmix(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@dataclass(frozen=True)
class _Grid:
    """Each tensor's cells: dim d is cut at ``cuts[d]`` (kept as ``tensor * scale +
    value``, tensor t's from ``cut_ptr[d][t]``, 0 and the global extent among them);
    cells are numbered row-major per tensor, tensor t's from ``cell_ptr[t]``."""

    scale: int
    cuts: tuple[np.ndarray, ...]
    cut_ptr: tuple[np.ndarray, ...]
    per_dim: np.ndarray  # (T, D) cells along each dim
    stride: np.ndarray  # (T, D)
    cell_ptr: np.ndarray

    @classmethod
    def of(cls, tensors: Tensors, tensor: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> _Grid:
        """The grid cut by the boxes ``lo``..``hi`` (inside their tensors)."""
        n_tensors, ndim = tensors.global_shape.shape
        scale = int(tensors.global_shape.max(initial=0)) + 1
        if scale * (n_tensors + 1) >= 2**62:
            raise ValueError(
                f"{n_tensors} tensors with extents up to {scale - 1}: too many to plan"
            )
        ids = np.arange(n_tensors, dtype=I64) * scale
        at = tensor * scale
        cuts: list[np.ndarray] = []
        cut_ptr: list[np.ndarray] = []
        per_dim = np.empty((n_tensors, ndim), I64)
        for d in range(ndim):
            ends = ids + tensors.global_shape[:, d]
            # Stable (timsort) on purpose: these keys come in long sorted runs.
            keys = np.sort(np.concatenate([ids, at + lo[:, d], at + hi[:, d], ends]), kind="stable")
            cuts.append(keys[boxes.run_flags(keys)])
            cut_ptr.append(np.searchsorted(cuts[d], np.append(ids, n_tensors * scale)))
            per_dim[:, d] = np.diff(cut_ptr[d]) - 1
        stride = boxes.row_major(per_dim)
        cell_ptr = np.r_[0, np.cumsum(stride[:, 0] * per_dim[:, 0])].astype(I64)
        return cls(scale, tuple(cuts), tuple(cut_ptr), per_dim, stride, cell_ptr)

    def span(self, tensor: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, ...]:
        """Per non-empty box inside its tensor: its first and last + 1 cell per dim."""
        first, stop = np.empty_like(lo), np.empty_like(hi)
        at = tensor * self.scale
        for d, (cuts, ptr) in enumerate(zip(self.cuts, self.cut_ptr, strict=True)):
            base = ptr[tensor]
            first[:, d] = np.searchsorted(cuts, at + lo[:, d], side="right") - 1 - base
            stop[:, d] = np.searchsorted(cuts, at + hi[:, d], side="left") - base
        return first, stop

    def number(self, tensor: np.ndarray, at: np.ndarray) -> np.ndarray:
        """The cell at per-dim positions ``at`` of each tensor."""
        return self.cell_ptr[tensor] + boxes.across(np.add, at * self.stride[tensor])

    def cells(
        self, tensor: np.ndarray, first: np.ndarray, stop: np.ndarray
    ) -> tuple[np.ndarray, ...]:
        """(box, cell) for every cell of every box's span."""
        extent = stop - first
        count = boxes.across(np.multiply, extent)
        if (count == 1).all():  # a grid layout: one cell per box
            return np.arange(len(count)), self.number(tensor, first)
        box, k = _expand(count)
        t = tensor[box]
        cell = self.cell_ptr[t]
        for d in range(extent.shape[1] - 1, -1, -1):
            e = extent[box, d]
            cell = cell + (first[box, d] + k % e) * self.stride[t, d]
            k = k // e
        return box, cell

    def bounds(self, cell: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tensor, lo, hi) of cells, for messages."""
        t = np.searchsorted(self.cell_ptr, cell, side="right") - 1
        rest = cell - self.cell_ptr[t]
        lo, hi = np.empty((2, len(cell), len(self.cuts)), I64)
        for d, (cuts, ptr) in enumerate(zip(self.cuts, self.cut_ptr, strict=True)):
            at = ptr[t] + rest // self.stride[t, d] % self.per_dim[t, d]
            lo[:, d], hi[:, d] = cuts[at] - t * self.scale, cuts[at + 1] - t * self.scale
        return t, lo, hi


@dataclass(frozen=True, eq=False)
class SourceIndex:
    """A source layout grouped and checked once, reused for every worker's plan.

    Regions are the distinct non-empty boxes; region g is held by owners
    ``owner_ptr[g]:owner_ptr[g + 1]`` (by rank), whose set of ranks hashes to
    ``owner_set[g]``. ``cell_region`` is the region covering each cell of ``grid``
    (-1: none). ``problems`` maps tensor numbers to what is wrong with their boxes:
    empty for a valid layout. ``key`` identifies the layout, to cache plans by."""

    tensors: Tensors
    sources: Sources
    problems: Problems
    region_tensor: np.ndarray
    region_start: np.ndarray
    region_shape: np.ndarray
    region_cells: np.ndarray  # how many cells each region spans (1 in a grid layout)
    owner_ptr: np.ndarray
    owner_rank: np.ndarray
    owner_index: np.ndarray
    owner_base: np.ndarray
    owner_set: np.ndarray
    grid: _Grid
    cell_region: np.ndarray

    @property
    def key(self) -> bytes:
        return self.tensors.key + self.sources.key


def index_sources(tensors: Tensors, sources: Sources) -> SourceIndex:
    """Group ``sources`` into regions and validate them. Never raises for a bad layout:
    ``SourceIndex.problems`` names, per tensor, boxes outside the global shape (or of
    an unknown tensor), gaps (elements no rank holds; a tensor no rank holds at all)
    and boxes that overlap other than as identical replicas. ``ValueError`` only for
    a layout too large to number (tensors x largest extent >= 2**62)."""
    s, problems = sources, Problems()
    keep = np.flatnonzero(
        ~boxes.outside(problems, tensors, s) & boxes.across(np.logical_and, s.shape > 0)
    )
    tensor, lo = s.tensor[keep], s.start[keep]  # empty boxes hold nothing
    hi = lo + s.shape[keep]
    grid = _Grid.of(tensors, tensor, lo, hi)
    first, stop = grid.span(tensor, lo, hi)
    # Identical boxes share their first and last cell, different ones do not.
    head, tail = grid.number(tensor, first), grid.number(tensor, stop - 1)
    order = np.lexsort((s.rank[keep], tail, head))
    head, tail, rank = head[order], tail[order], s.rank[keep][order]
    new = boxes.run_flags(head) | boxes.run_flags(tail)
    again = ~new & ~boxes.run_flags(rank)  # a rank listing a box twice holds it once
    order, new = order[~again], new[~again]
    firsts = np.flatnonzero(new)
    region = order[firsts]
    box, cell = grid.cells(tensor[region], first[region], stop[region])
    cover = np.bincount(cell, minlength=int(grid.cell_ptr[-1]))
    cell_region = np.full(len(cover), -1, I64)
    cell_region[cell] = box
    _gaps(problems, tensors, grid, cover, tensor[region])
    _overlaps(problems, tensors, grid, cover, box, cell, s, keep[region])
    piece, shape = keep[order], s.shape[keep][region]
    cells_each = np.bincount(box, minlength=len(region))
    owners = (np.r_[firsts, len(order)].astype(I64), s.rank[piece], s.index[piece], s.base[piece])
    owner_set = np.add.reduceat(_splitmix(owners[1]), firsts) if len(firsts) else firsts
    regions = (tensor[region], lo[region], shape, cells_each, *owners, owner_set.view(I64))
    return SourceIndex(tensors, s, problems, *regions, grid, cell_region)


def _gaps(
    problems: Problems, tensors: Tensors, grid: _Grid, cover: np.ndarray, held: np.ndarray
) -> None:
    """Note, per tensor, the elements no region covers."""
    holes = np.flatnonzero(cover == 0)
    if not len(holes):
        return
    t, lo, hi = grid.bounds(holes)
    missing = np.zeros(len(tensors.itemsize), I64)
    np.add.at(missing, t, (hi - lo).prod(1))
    regions = np.bincount(held, minlength=len(tensors.itemsize))
    for i in boxes.first_each(t):
        where = boxes.box_text(tensors.global_shape[t[i]], lo[i], hi[i] - lo[i])
        text = f"its boxes leave {missing[t[i]]} elements no rank holds, from {where}"
        problems.setdefault(int(t[i]), []).append(text if regions[t[i]] else "no rank holds it")


def _overlaps(
    problems: Problems,
    tensors: Tensors,
    grid: _Grid,
    cover: np.ndarray,
    box: np.ndarray,
    cell: np.ndarray,
    sources: Sources,
    region: np.ndarray,
) -> None:
    """Note, per tensor, two different boxes that share elements (at its first shared cell)."""
    shared = np.flatnonzero(cover > 1)
    if not len(shared):
        return
    first = shared[boxes.first_each(np.searchsorted(grid.cell_ptr, shared, side="right"))]
    hit = np.isin(cell, first)
    at = np.searchsorted(first, cell[hit])
    one, other = np.full(len(first), len(region)), np.full(len(first), -1)
    np.minimum.at(one, at, box[hit])
    np.maximum.at(other, at, box[hit])
    for a, b in zip(region[one], region[other], strict=True):
        t, g = int(sources.tensor[a]), tensors.global_shape[sources.tensor[a]]
        two = [
            f"rank {sources.rank[i]}'s {boxes.box_text(g, sources.start[i], sources.shape[i])}"
            for i in (a, b)
        ]
        problems.setdefault(t, []).append(
            f"boxes overlap without being the same box: {' and '.join(two)}"
        )


@dataclass(frozen=True, eq=False)
class Plan:
    """Runs for one worker: row i reads ``count[i]`` runs of ``length[i]`` bytes, the
    k-th at ``src_offset[i] + k * src_stride[i]`` of tensor ``index[i]`` of rank
    ``rank[i]``'s object, and writes it at ``dest_offset[i] + k * dest_stride[i]`` of
    destination ``dest[i]``. Strides equal ``length`` where ``count`` is 1. Rows are
    sorted by (rank, index, src_offset); rank ``ranks[j]`` has rows
    ``rank_ptr[j]:rank_ptr[j + 1]`` (see ``by_rank``)."""

    rank: np.ndarray
    index: np.ndarray
    src_offset: np.ndarray
    length: np.ndarray
    count: np.ndarray
    src_stride: np.ndarray
    dest: np.ndarray
    dest_offset: np.ndarray
    dest_stride: np.ndarray
    ranks: np.ndarray
    rank_ptr: np.ndarray

    def __len__(self) -> int:
        return len(self.rank)

    @property
    def nbytes(self) -> int:
        return int((self.length * self.count).sum())

    def by_rank(self) -> Iterator[tuple[int, slice]]:
        """(rank, rows) for each rank read from: index any column with ``rows``."""
        for j, rank in enumerate(self.ranks.tolist()):
            yield rank, slice(int(self.rank_ptr[j]), int(self.rank_ptr[j + 1]))

    def bytes_per_rank(self, n_ranks: int = 0) -> np.ndarray:
        """Bytes read from each rank 0..max(n_ranks, highest rank + 1) - 1."""
        out = np.zeros(max(n_ranks, int(self.ranks.max(initial=-1)) + 1), I64)
        if len(self):
            out[self.ranks] = np.add.reduceat(self.length * self.count, self.rank_ptr[:-1])
        return out

    def bytes_per_dest(self) -> tuple[np.ndarray, np.ndarray]:
        """(dest ids ascending, bytes written into each)."""
        order = np.argsort(self.dest, kind="stable")
        firsts = np.flatnonzero(boxes.run_flags(self.dest[order]))
        return self.dest[order][firsts], np.add.reduceat((self.length * self.count)[order], firsts)


def check(index: SourceIndex, targets: Targets) -> Problems:
    """What ``plan(index, targets)`` would refuse, per tensor: target boxes outside
    their global shape (or of an unknown tensor), target elements no rank holds, and
    ``index.problems`` of every tensor the targets touch. Empty: ``plan`` succeeds."""
    return _match(index, targets)[2]


def plan(index: SourceIndex, targets: Targets, worker: int = 0) -> Plan:
    """The runs that fill ``targets`` (one worker's pieces) from ``index``'s ranks.

    Every byte of every non-empty target piece is written exactly once; only the
    intersections of target and source boxes are read, in runs as long as both
    layouts allow. What several ranks hold is read from one of them: per set of
    owning ranks, this worker's pieces are laid end to end and the owners take equal
    consecutive shares, the first going to owner ``worker % owners``, so the choice
    is deterministic in ``worker`` and spreads over the owners within this plan and
    across workers. Cache the result by ``(index.key, targets.key, worker)``.
    Raises ``LayoutError`` with ``check``'s problems, if any."""
    piece, region, problems = _match(index, targets)
    if problems:
        raise LayoutError(problems)
    at, r_at, r_shape = targets.start[piece], index.region_start[region], index.region_shape[region]
    lo = np.maximum(at, r_at)
    extent = np.minimum(at + targets.shape[piece], r_at + r_shape) - lo
    itemsize = index.tensors.itemsize[targets.tensor[piece]]
    owner = _choose(index, region, boxes.across(np.multiply, extent) * itemsize, worker)
    rows = _runs(extent, lo - r_at, r_shape, lo - at, targets.shape[piece], itemsize)
    owner, piece = owner[rows.box], piece[rows.box]
    return _finish(
        dict(
            rank=index.owner_rank[owner],
            index=index.owner_index[owner],
            src_offset=index.owner_base[owner] + rows.src,
            length=rows.length,
            count=rows.count,
            src_stride=rows.src_stride,
            dest=targets.dest[piece],
            dest_offset=targets.dest_base[piece] + rows.dest,
            dest_stride=rows.dest_stride,
        )
    )


def _match(index: SourceIndex, targets: Targets) -> tuple[np.ndarray, np.ndarray, Problems]:
    """(target piece, region) for every region each valid non-empty piece meets, and
    the problems that forbid planning."""
    problems, wrong = Problems(), Problems()
    bad = boxes.outside(wrong, index.tensors, targets)
    n_tensors = len(index.tensors.itemsize)
    named = np.zeros(n_tensors + 1, bool)
    named[np.where((targets.tensor >= 0) & (targets.tensor < n_tensors), targets.tensor, -1)] = True
    for t, messages in sorted(index.problems.items()):
        if 0 <= t < n_tensors and named[t]:
            problems[t] = list(messages)
    for t, messages in wrong.items():
        problems.setdefault(t, []).extend(messages)
    live = np.flatnonzero(~bad & boxes.across(np.logical_and, targets.shape > 0))
    tensor, lo = targets.tensor[live], targets.start[live]
    grid = index.grid
    box, cell = grid.cells(tensor, *grid.span(tensor, lo, lo + targets.shape[live]))
    region = index.cell_region[cell]
    for i in np.flatnonzero(region < 0)[boxes.first_each(tensor[box[region < 0]])]:
        t, p = int(tensor[box[i]]), live[box[i]]
        text = boxes.box_text(index.tensors.global_shape[t], targets.start[p], targets.shape[p])
        problems.setdefault(t, []).append(f"target box {text} needs elements no rank holds")
    wide = np.flatnonzero(index.region_cells[region] > 1)
    if len(wide):  # a region spanning several cells meets a piece once
        again = np.zeros(len(region), bool)
        again[wide] = True
        again[wide[boxes.first_each(box[wide] * len(index.region_cells) + region[wide])]] = False
        box, region = box[~again], region[~again]
    return live[box], region, problems


def _choose(index: SourceIndex, region: np.ndarray, nbytes: np.ndarray, worker: int) -> np.ndarray:
    """The owner row each intersection is read from (see ``plan``)."""
    owner = index.owner_ptr[region].copy()
    owners = index.owner_ptr[region + 1] - owner
    shared = np.flatnonzero(owners > 1)
    if not len(shared):
        return owner
    # Lay the pieces of each owner set end to end (deterministic order), cut the line
    # into equal shares and rotate the shares by worker: every owner reads about
    # 1/k of the set's bytes here, and each piece's owner turns with the worker.
    order = shared[np.argsort(index.owner_set[region[shared]], kind="stable")]
    flags = boxes.run_flags(index.owner_set[region[order]])
    group = np.cumsum(flags) - 1
    size = nbytes[order]
    end = np.cumsum(size)
    base = (end - size)[flags][group]
    total = np.add.reduceat(size, np.flatnonzero(flags))[group]
    k = owners[order]
    owner[order] += ((2 * (end - base) - size) * k // (2 * total) + worker) % k
    return owner


@dataclass(frozen=True)
class _Rows:
    """Rows of runs, offsets in bytes from their boxes' first elements."""

    box: np.ndarray  # which intersection each row copies (part of)
    src: np.ndarray
    dest: np.ndarray
    length: np.ndarray
    count: np.ndarray
    src_stride: np.ndarray
    dest_stride: np.ndarray


def _runs(
    extent: np.ndarray,
    src_at: np.ndarray,
    src_shape: np.ndarray,
    dest_at: np.ndarray,
    dest_shape: np.ndarray,
    itemsize: np.ndarray,
) -> _Rows:
    """Rows copying boxes ``extent`` from ``src_at`` in row-major ``src_shape`` to
    ``dest_at`` in ``dest_shape``. Dims merge into the run while both sides stay
    contiguous, then into one strided level while both strides stay regular; any
    dims left over become separate rows."""
    n, ndim = extent.shape
    ss, ds = boxes.row_major(src_shape), boxes.row_major(dest_shape)
    run, count = np.ones(n, I64), np.ones(n, I64)
    level_ss, level_ds = np.zeros(n, I64), np.zeros(n, I64)
    phase = np.zeros(n, np.int8)  # 0: growing the run, 1: the strided level, 2: rows
    rows = np.ones_like(extent)
    for d in range(ndim - 1, -1, -1):  # a dim of extent 1 changes nothing
        e, live = extent[:, d], extent[:, d] > 1
        grow = live & (phase == 0) & (ss[:, d] == run) & (ds[:, d] == run)
        begin = live & (phase == 0) & ~grow
        extend = (
            live & (phase == 1) & (ss[:, d] == count * level_ss) & (ds[:, d] == count * level_ds)
        )
        spill = live & (phase > 0) & ~extend
        run = np.where(grow, run * e, run)
        level_ss, level_ds = (
            np.where(begin, ss[:, d], level_ss),
            np.where(begin, ds[:, d], level_ds),
        )
        count = np.where(begin, e, np.where(extend, count * e, count))
        rows[:, d] = np.where(spill, e, 1)
        phase = np.where(begin, 1, np.where(spill, 2, phase)).astype(np.int8)
    src, dest = boxes.across(np.add, src_at * ss), boxes.across(np.add, dest_at * ds)
    per = boxes.across(np.multiply, rows)
    box = np.arange(n)
    if (per > 1).any():
        box, k = _expand(per)
        src, dest = src[box], dest[box]
        for d in np.flatnonzero((rows > 1).any(0))[::-1]:
            e = rows[box, d]
            src, dest, k = src + k % e * ss[box, d], dest + k % e * ds[box, d], k // e
    w = itemsize[box]
    length, count, one = run[box] * w, count[box], count[box] == 1
    src_stride = np.where(one, length, level_ss[box] * w)
    dest_stride = np.where(one, length, level_ds[box] * w)
    return _Rows(box, src * w, dest * w, length, count, src_stride, dest_stride)


def _finish(c: dict[str, np.ndarray]) -> Plan:
    """The plan of rows ``c`` sorted by (rank, index, src_offset), single runs that
    follow each other on both sides joined (neighbouring pieces of one rank's buffer
    that land next to each other in one destination)."""
    order = np.lexsort((c["src_offset"], c["index"], c["rank"]))
    c = {name: column[order] for name, column in c.items()}
    single, length = c["count"] == 1, c["length"]
    join = (
        single
        & ~boxes.run_flags(c["rank"])
        & ~boxes.run_flags(c["index"])
        & ~boxes.run_flags(c["dest"])
    )
    join[1:] &= single[:-1]
    join[1:] &= c["src_offset"][1:] == c["src_offset"][:-1] + length[:-1]
    join[1:] &= c["dest_offset"][1:] == c["dest_offset"][:-1] + length[:-1]
    if join.any():
        keep = np.flatnonzero(~join)
        c = {name: column[keep] for name, column in c.items()}
        c["length"] = length = np.add.reduceat(length, keep)
        for name in ("src_stride", "dest_stride"):
            c[name] = np.where(c["count"] == 1, length, c[name])
    firsts = np.flatnonzero(boxes.run_flags(c["rank"]))
    return Plan(**c, ranks=c["rank"][firsts], rank_ptr=np.r_[firsts, len(length)].astype(I64))
