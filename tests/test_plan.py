"""The resharding planner (``_plan``, with its input ``_boxes``), in one process: no Ray.

Plans run here against fake memory: every rank's buffer holds, at each byte of a
piece, a code for (tensor, global element, byte of the element), so a plan that
reads a wrong byte, misses one or writes one twice cannot pass. Random layouts come
from hypothesis: guillotine partitions (grids and non-grids), replicated boxes,
pieces split into blocks as ``shard_blocks`` lays them out, empty DTensor shards,
and overlapping target boxes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import (
    _compute_local_shape_and_global_offset,
    compute_local_shape_and_global_offset,
)
from torch.testing._internal.distributed.fake_pg import FakeStore

from raydirect._boxes import Sources, Targets, Tensors, agree, dtensor_boxes, pack, pad
from raydirect._plan import LayoutError, Plan, check, index_sources, plan

D = 4  # every box padded to 4 dims
Box = tuple[Sequence[int], Sequence[int]]  # (start, shape), unpadded

# -- building layouts ---------------------------------------------------------------


def tensors_of(shapes: Sequence[Sequence[int]], itemsize: Sequence[int] | int = 4) -> Tensors:
    sizes = [itemsize] * len(shapes) if isinstance(itemsize, int) else itemsize
    return Tensors(itemsize=sizes, global_shape=pad(shapes, D))


def sources_of(
    tensors: Tensors,
    pieces: Sequence[tuple[int, int, Sequence[int], Sequence[int]]],
    index: Sequence[int] | None = None,
    align: int = 1,
) -> Sources:
    """(tensor, rank, start, shape) pieces, laid back to back per (rank, index)."""
    tensor = np.array([p[0] for p in pieces], dtype=np.int64)
    rank = np.array([p[1] for p in pieces], dtype=np.int64)
    start, shape = pad([p[2] for p in pieces], D, 0), pad([p[3] for p in pieces], D)
    index_ = np.zeros(len(pieces), np.int64) if index is None else np.array(index, np.int64)
    nbytes = shape.prod(1) * tensors.itemsize[tensor]
    base = pack(rank * 2 + index_, nbytes, align)
    return Sources(tensor=tensor, rank=rank, start=start, shape=shape, index=index_, base=base)


def targets_of(
    tensors: Tensors, pieces: Sequence[tuple[int, Sequence[int], Sequence[int]]], dest=None
) -> Targets:
    """(tensor, start, shape) pieces, each its own destination unless ``dest`` says;
    pieces sharing a destination lie back to back in it."""
    tensor = np.array([p[0] for p in pieces], dtype=np.int64)
    start, shape = pad([p[1] for p in pieces], D, 0), pad([p[2] for p in pieces], D)
    dest = np.arange(len(pieces)) if dest is None else np.asarray(dest)
    base = pack(
        dest, shape.prod(1) * tensors.itemsize[np.minimum(tensor, len(tensors.itemsize) - 1)]
    )
    return Targets(tensor=tensor, start=start, shape=shape, dest=dest, dest_base=base)


def whole(shape: Sequence[int]) -> Box:
    return (0,) * len(shape), tuple(shape)


# -- executing plans on fake memory ----------------------------------------------------


def _codes(tensors: Tensors, tensor: int, start: np.ndarray, shape: np.ndarray) -> np.ndarray:
    """The code of every byte of a box, row-major: (tensor, global element, byte)."""
    w, limit = int(tensors.itemsize[tensor]), tensors.global_shape[tensor]
    where = np.indices(shape).reshape(D, -1) + start[:, None]
    element = np.ravel_multi_index(where, limit) if where.size else np.zeros(0, np.int64)
    return (((tensor * 100_000 + element)[:, None] * 8) + np.arange(w)).reshape(-1) + 1


def _memory(tensors: Tensors, sources: Sources) -> dict[tuple[int, int], np.ndarray]:
    """Each (rank, index)'s buffer: codes where its pieces lie, -1 elsewhere."""
    nbytes = sources.shape.prod(1) * tensors.itemsize[sources.tensor]
    memory: dict[tuple[int, int], np.ndarray] = {}
    for i in range(len(sources.tensor)):
        key = (int(sources.rank[i]), int(sources.index[i]))
        end = int(sources.base[i] + nbytes[i])
        buf = memory.setdefault(key, np.full(0, -1, np.int64))
        if len(buf) < end:
            buf = memory[key] = np.concatenate([buf, np.full(end - len(buf), -1, np.int64)])
        buf[sources.base[i] : end] = _codes(
            tensors, sources.tensor[i], sources.start[i], sources.shape[i]
        )
    return memory


def _expected(tensors: Tensors, targets: Targets) -> dict[int, np.ndarray]:
    out: dict[int, np.ndarray] = {}
    for i in range(len(targets.tensor)):
        codes = _codes(tensors, targets.tensor[i], targets.start[i], targets.shape[i])
        buf = out.setdefault(int(targets.dest[i]), np.zeros(0, np.int64))
        end = int(targets.dest_base[i]) + len(codes)
        if len(buf) < end:
            buf = out[int(targets.dest[i])] = np.concatenate(
                [buf, np.zeros(end - len(buf), np.int64)]
            )
        buf[targets.dest_base[i] : end] = codes
    return out


def _execute(
    p: Plan, memory, sizes: dict[int, int]
) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Run ``p`` over ``memory``: every destination's bytes and how often each was written."""
    row = np.repeat(np.arange(len(p)), p.count)
    k = np.arange(len(row)) - (np.cumsum(p.count) - p.count)[row]
    run = np.repeat(np.arange(len(row)), p.length[row])
    b = np.arange(len(run)) - (np.cumsum(p.length[row]) - p.length[row])[run]
    r, k = row[run], k[run]
    src, dst = (
        p.src_offset[r] + k * p.src_stride[r] + b,
        p.dest_offset[r] + k * p.dest_stride[r] + b,
    )
    got = {d: np.zeros(n, np.int64) for d, n in sizes.items()}
    writes = {d: np.zeros(n, np.int64) for d, n in sizes.items()}
    for (rank, index), buf in memory.items():
        for dest in sizes:
            sel = (p.rank[r] == rank) & (p.index[r] == index) & (p.dest[r] == dest)
            got[dest][dst[sel]] = buf[src[sel]]
            np.add.at(writes[dest], dst[sel], 1)
    return got, writes


def assert_plan_fills(
    tensors: Tensors, sources: Sources, targets: Targets, worker: int = 0
) -> Plan:
    """Plan, execute on fake memory, and check every target byte is right and written once,
    that exactly the targets' bytes moved, and the plan's own invariants."""
    index = index_sources(tensors, sources)
    assert index.problems == {}
    assert check(index, targets) == {}
    p = plan(index, targets, worker)
    want = _expected(tensors, targets)
    got, writes = _execute(p, _memory(tensors, sources), {d: len(a) for d, a in want.items()})
    for dest, expected in want.items():
        assert (writes[dest] == 1).all(), (
            f"dest {dest}: bytes written {writes[dest].tolist()} times"
        )
        np.testing.assert_array_equal(got[dest], expected)
    assert p.nbytes == sum(len(a) for a in want.values())  # only the intersections moved
    _assert_invariants(p)
    return p


def _assert_invariants(p: Plan) -> None:
    assert (p.length > 0).all() and (p.count >= 1).all()
    single = p.count == 1
    assert (p.src_stride[single] == p.length[single]).all()
    assert (p.dest_stride[single] == p.length[single]).all()
    # Maximal: a strided row whose runs are back to back on both sides is one run.
    assert not ((~single) & (p.src_stride == p.length) & (p.dest_stride == p.length)).any()
    order = np.lexsort((p.src_offset, p.index, p.rank))
    assert (order == np.arange(len(p))).all()
    rows = list(p.by_rank())
    assert [r for r, _ in rows] == sorted(set(p.rank.tolist()))
    assert sum(s.stop - s.start for _, s in rows) == len(p)
    assert all((p.rank[s] == r).all() for r, s in rows)
    assert p.bytes_per_rank().sum() == p.nbytes == p.bytes_per_dest()[1].sum()


# -- random layouts: every target byte right, once ---------------------------------


def _guillotine(
    draw, lo: list[int], hi: list[int], depth: int
) -> list[tuple[list[int], list[int]]]:
    """Boxes tiling lo..hi: cut along a random dim, then each half again (not a grid:
    the halves are cut independently)."""
    dims = [d for d in range(len(lo)) if hi[d] - lo[d] > 1]
    if depth == 0 or not dims or not draw(st.booleans()):
        return [(lo, hi)]
    d = draw(st.sampled_from(dims))
    cut = draw(st.integers(lo[d] + 1, hi[d] - 1))
    left_hi, right_lo = [*hi[:d], cut, *hi[d + 1 :]], [*lo[:d], cut, *lo[d + 1 :]]
    return _guillotine(draw, lo, left_hi, depth - 1) + _guillotine(draw, right_lo, hi, depth - 1)


def _blocks(draw, lo: list[int], hi: list[int]) -> list[tuple[list[int], list[int]]]:
    """A box as ``shard_blocks`` stores it: whole, or split along one dim into blocks."""
    dims = [d for d in range(len(lo)) if hi[d] - lo[d] > 1]
    if not dims or not draw(st.booleans()):
        return [(lo, hi)]
    d = draw(st.sampled_from(dims))
    cuts = sorted(draw(st.sets(st.integers(lo[d] + 1, hi[d] - 1), min_size=1)))
    edges = [lo[d], *cuts, hi[d]]
    return [
        ([*lo[:d], a, *lo[d + 1 :]], [*hi[:d], b, *hi[d + 1 :]])
        for a, b in zip(edges, edges[1:], strict=False)
    ]


@st.composite
def layouts(draw) -> tuple[Tensors, Sources, Targets, int]:
    shapes = draw(
        st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=4), min_size=1, max_size=3)
    )
    tensors = tensors_of(
        shapes,
        draw(st.lists(st.sampled_from([1, 2, 4, 8]), min_size=len(shapes), max_size=len(shapes))),
    )
    pieces, targets = [], []
    for t, shape in enumerate(shapes):
        for lo, hi in _guillotine(draw, [0] * len(shape), list(shape), draw(st.integers(0, 5))):
            owners = sorted(draw(st.sets(st.integers(0, 3), min_size=1, max_size=3)))
            for a, b in _blocks(draw, lo, hi):
                pieces += [(t, r, a, [y - x for x, y in zip(a, b, strict=True)]) for r in owners]
        if draw(st.booleans()):  # an empty DTensor shard: at the global extent, size 0
            pieces.append(
                (t, draw(st.integers(0, 3)), [shape[0], *[0] * (len(shape) - 1)], [0, *shape[1:]])
            )
        for _ in range(draw(st.integers(1, 3))):
            lo = [draw(st.integers(0, n)) for n in shape]
            targets.append(
                (t, lo, [draw(st.integers(0, n - a)) for a, n in zip(lo, shape, strict=True)])
            )
    order = draw(st.permutations(range(len(pieces))))
    pieces = [pieces[i] for i in order]
    index = draw(st.lists(st.integers(0, 1), min_size=len(pieces), max_size=len(pieces)))
    sources = sources_of(tensors, pieces, index, align=draw(st.sampled_from([1, 16])))
    dest = draw(st.lists(st.integers(0, 2), min_size=len(targets), max_size=len(targets)))
    return tensors, sources, targets_of(tensors, targets, dest), draw(st.integers(0, 50))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_random_layouts_fill_every_target_byte_once_and_move_only_the_intersections(case):
    assert_plan_fills(*case)


# -- runs as long as the layouts allow ------------------------------------------------


def _rows(p: Plan) -> list[tuple[int, ...]]:
    names = (
        "rank",
        "src_offset",
        "length",
        "count",
        "src_stride",
        "dest",
        "dest_offset",
        "dest_stride",
    )
    return [tuple(int(getattr(p, n)[i]) for n in names) for i in range(len(p))]


def test_whole_rows_of_a_source_region_are_one_run():
    tensors = tensors_of([(8, 6)], 4)  # rows 0:4 on rank 0, 4:8 on rank 1
    sources = sources_of(tensors, [(0, 0, (0, 0), (4, 6)), (0, 1, (4, 0), (4, 6))])
    inside = assert_plan_fills(tensors, sources, targets_of(tensors, [(0, (1, 0), (3, 6))]))
    assert _rows(inside) == [(0, 24, 72, 1, 72, 0, 0, 72)]  # rows 1:4 of rank 0: one run
    across = assert_plan_fills(tensors, sources, targets_of(tensors, [(0, (2, 0), (4, 6))]))
    assert _rows(across) == [(0, 48, 48, 1, 48, 0, 0, 48), (1, 0, 48, 1, 48, 0, 48, 48)]


def test_columns_are_one_strided_row_per_source_region():
    tensors = tensors_of([(8, 6)], 2)
    sources = sources_of(tensors, [(0, 0, (0, 0), (4, 6)), (0, 1, (4, 0), (4, 6))])
    p = assert_plan_fills(tensors, sources, targets_of(tensors, [(0, (0, 2), (8, 3))]))
    # 4 runs of 3 columns (6 bytes), 12 bytes apart in the source, back to back in the target.
    assert _rows(p) == [(0, 4, 6, 4, 12, 0, 0, 6), (1, 4, 6, 4, 12, 0, 24, 6)]


def test_dims_merge_into_one_strided_level_where_both_strides_allow():
    tensors = tensors_of([(4, 3, 5)], 1)
    sources = sources_of(tensors, [(0, 0, (0, 0, 0), (4, 3, 5))])
    # [1:3, :, 1:4]: 2 x 3 runs of 3 bytes, 5 apart in the source, 3 in the target: one row.
    one = assert_plan_fills(tensors, sources, targets_of(tensors, [(0, (1, 0, 1), (2, 3, 3))]))
    assert _rows(one) == [(0, 16, 3, 6, 5, 0, 0, 3)]
    # [1:3, 0:2, 1:4]: the outer dim no longer continues the stride: a row per outer index.
    two = assert_plan_fills(tensors, sources, targets_of(tensors, [(0, (1, 0, 1), (2, 2, 3))]))
    assert _rows(two) == [(0, 16, 3, 2, 5, 0, 0, 3), (0, 31, 3, 2, 5, 0, 6, 3)]


def test_neighbouring_pieces_of_a_rank_are_read_as_one_run():
    # shard_blocks along rows: two blocks back to back in rank 0's buffer.
    tensors = tensors_of([(4, 6)], 4)
    sources = sources_of(tensors, [(0, 0, (0, 0), (2, 6)), (0, 0, (2, 0), (2, 6))])
    p = assert_plan_fills(tensors, sources, targets_of(tensors, [(0, *whole((4, 6)))]))
    assert _rows(p) == [(0, 0, 96, 1, 96, 0, 0, 96)]


def test_column_blocks_give_a_strided_row_per_block():
    # shard_blocks along columns: each block contiguous, so whole rows are strided reads.
    tensors = tensors_of([(4, 6)], 1)
    sources = sources_of(tensors, [(0, 0, (0, 0), (4, 3)), (0, 0, (0, 3), (4, 3))])
    p = assert_plan_fills(tensors, sources, targets_of(tensors, [(0, *whole((4, 6)))]))
    assert _rows(p) == [(0, 0, 3, 4, 3, 0, 0, 6), (0, 12, 3, 4, 3, 0, 3, 6)]


def test_a_partial_overlap_moves_only_the_overlap():
    tensors = tensors_of([(100, 10)], 2)
    sources = sources_of(tensors, [(0, r, (25 * r, 0), (25, 10)) for r in range(4)])
    p = assert_plan_fills(tensors, sources, targets_of(tensors, [(0, (20, 0), (10, 10))]))
    assert p.bytes_per_rank(4).tolist() == [5 * 10 * 2, 5 * 10 * 2, 0, 0]


def test_runs_join_only_where_they_follow_each_other_on_both_sides():
    # Tensors 0 and 1 lie back to back in rank 0's buffer.
    tensors = tensors_of([(4,), (4,)], 2)
    sources = sources_of(tensors, [(0, 0, (0,), (4,)), (1, 0, (0,), (4,))])
    same = targets_of(tensors, [(0, *whole((4,))), (1, *whole((4,)))], dest=[7, 7])
    assert _rows(assert_plan_fills(tensors, sources, same)) == [(0, 0, 16, 1, 16, 7, 0, 16)]
    swapped = targets_of(tensors, [(1, *whole((4,))), (0, *whole((4,)))], dest=[7, 7])
    p = assert_plan_fills(tensors, sources, swapped)
    assert _rows(p) == [(0, 0, 8, 1, 8, 7, 8, 8), (0, 8, 8, 1, 8, 7, 0, 8)]
    apart = targets_of(tensors, [(0, *whole((4,))), (1, *whole((4,)))])  # two destinations
    assert len(assert_plan_fills(tensors, sources, apart)) == 2


# -- refused before a byte moves, naming the tensor ----------------------------------


def _problems(shapes, pieces, targets) -> dict[int, list[str]]:
    tensors = tensors_of(shapes)
    index = index_sources(tensors, sources_of(tensors, pieces))
    wanted = targets_of(tensors, targets)
    problems = check(index, wanted)
    with pytest.raises(LayoutError) as refused:
        plan(index, wanted)
    assert refused.value.problems == problems
    for t in problems:
        assert f"tensor {t}:" in str(refused.value)
    return problems


def test_a_gap_is_refused_with_the_elements_no_rank_holds():
    problems = _problems(
        [(8, 4), (3,)],
        [(0, 0, (0, 0), (3, 4)), (0, 1, (5, 0), (3, 4)), (1, 0, (0,), (3,))],
        [(0, *whole((8, 4))), (1, *whole((3,)))],
    )
    assert list(problems) == [0]
    assert problems[0][0] == "its boxes leave 8 elements no rank holds, from [3:5, 0:4]"
    assert problems[0][1] == "target box [0:8, 0:4] needs elements no rank holds"


def test_boxes_that_overlap_partly_are_refused_naming_both():
    problems = _problems(
        [(8, 4)], [(0, 0, (0, 0), (5, 4)), (0, 1, (4, 0), (4, 4))], [(0, *whole((8, 4)))]
    )
    assert problems == {
        0: ["boxes overlap without being the same box: rank 0's [0:5, 0:4] and rank 1's [4:8, 0:4]"]
    }


def test_a_box_inside_a_replica_is_an_overlap_not_a_replica():
    problems = _problems(
        [(8,)], [(0, 0, (0,), (8,)), (0, 1, (0,), (4,)), (0, 1, (4,), (4,))], [(0, *whole((8,)))]
    )
    assert "overlap" in problems[0][0]


def test_boxes_outside_the_global_shape_are_refused():
    problems = _problems(
        [(8, 4)], [(0, 0, (0, 0), (8, 4)), (0, 1, (6, 0), (4, 4))], [(0, (7, 0), (2, 4))]
    )
    assert problems == {
        0: [
            "rank 1's box [6:10, 0:4] lies outside its global shape (8, 4)",
            "target box [7:9, 0:4] lies outside its global shape (8, 4)",
        ]
    }


def test_a_target_tensor_no_rank_holds_is_refused():
    problems = _problems([(4,), (4,)], [(0, 0, (0,), (4,))], [(0, *whole((4,))), (1, *whole((4,)))])
    assert problems == {1: ["no rank holds it", "target box [0:4] needs elements no rank holds"]}
    unknown = _problems([(4,)], [(0, 0, (0,), (4,))], [(3, *whole((4,)))])
    assert unknown == {3: ["target box [0:4] lies outside any tensor's"]}


def test_problems_of_tensors_a_worker_does_not_load_are_the_index_s_alone():
    tensors = tensors_of([(4,), (4,)])
    index = index_sources(tensors, sources_of(tensors, [(0, 0, (0,), (4,)), (1, 0, (0,), (2,))]))
    assert index.problems == {1: ["its boxes leave 2 elements no rank holds, from [2:4]"]}
    assert check(index, targets_of(tensors, [(0, *whole((4,)))])) == {}


def test_identical_replicas_and_a_box_listed_twice_are_accepted():
    tensors = tensors_of([(6, 2)], 2)
    pieces = [(0, r, (0, 0), (3, 2)) for r in (0, 2, 1)] + [
        (0, r, (3, 0), (3, 2)) for r in (1, 1, 3)
    ]
    index = index_sources(tensors, sources_of(tensors, pieces))
    assert index.problems == {}
    assert index.owner_rank.tolist() == [0, 1, 2, 1, 3]  # per region, by rank, each once
    assert_plan_fills(
        tensors, sources_of(tensors, pieces), targets_of(tensors, [(0, (1, 0), (4, 2))])
    )


def test_columns_must_agree_in_length_and_dims():
    tensors = tensors_of([(4,)])
    with pytest.raises(ValueError, match="'rank' has 2 rows, not 1"):
        Sources(
            tensor=[0], rank=[0, 1], start=[[0, 0, 0, 0]], shape=[[1, 1, 1, 4]], index=[0], base=[0]
        )
    with pytest.raises(ValueError, match="negative"):
        Targets(tensor=[0], start=[[0] * 4], shape=[[1, 1, 1, 4]], dest=[0], dest_base=[-1])
    flat = Sources(tensor=[0], rank=[0], start=[[0]], shape=[[4]], index=[0], base=[0])
    with pytest.raises(ValueError, match="boxes of 1 dims for tensors of 4"):
        index_sources(tensors, flat)


def test_no_sources_or_no_targets_plan_to_nothing():
    tensors = tensors_of([(4,)])
    none = Sources(tensor=[], rank=[], start=pad([], D), shape=pad([], D), index=[], base=[])
    assert index_sources(tensors, none).problems == {0: ["no rank holds it"]}
    index = index_sources(tensors, sources_of(tensors, [(0, 0, (0,), (4,))]))
    p = plan(index, targets_of(tensors, []))
    assert len(p) == 0 and p.nbytes == 0 and list(p.by_rank()) == []


# -- replicas: read once, spread over their owners -------------------------------------


def test_workers_read_a_replicated_tensor_from_every_owner_in_turn():
    tensors = tensors_of([(64, 32)], 2)
    sources = sources_of(tensors, [(0, r, (0, 0), (64, 32)) for r in range(4)])
    index = index_sources(tensors, sources)
    wanted = targets_of(tensors, [(0, *whole((64, 32)))])
    read = [plan(index, wanted, worker).ranks.tolist() for worker in range(8)]
    assert all(len(ranks) == 1 for ranks in read)  # once per worker, from one owner
    assert Counter(r for (r,) in read) == {0: 2, 1: 2, 2: 2, 3: 2}
    assert [plan(index, wanted, w).ranks.tolist() for w in range(8)] == read  # deterministic


def test_one_worker_spreads_its_replicated_reads_over_the_owners():
    tensors = tensors_of([(16, 16)] * 8, 4)
    sources = sources_of(tensors, [(t, r, (0, 0), (16, 16)) for t in range(8) for r in range(4)])
    index = index_sources(tensors, sources)
    p = plan(index, targets_of(tensors, [(t, *whole((16, 16))) for t in range(8)]), worker=5)
    assert p.bytes_per_rank(4).tolist() == [2 * 16 * 16 * 4] * 4


def test_replicated_shards_balance_the_source_ranks_over_all_workers():
    # HSDP: 8 ranks = 2 replicas x 4 row shards of each weight, a norm on all 8 ranks.
    # 8 workers = 2 data-parallel x 4 tensor-parallel, holding column slices.
    shapes = [(64, 48)] * 6 + [(48,)]
    tensors = tensors_of(shapes, 2)
    pieces = [
        (t, 4 * rep + s, (16 * s, 0), (16, 48))
        for t in range(6)
        for rep in range(2)
        for s in range(4)
    ]
    pieces += [(6, r, (0,), (48,)) for r in range(8)]
    index = index_sources(tensors, sources_of(tensors, pieces))
    per_rank = np.zeros(8, np.int64)
    for worker in range(8):
        tp = worker % 4
        mine = [(t, (0, 12 * tp), (64, 12)) for t in range(6)] + [(6, *whole((48,)))]
        per_rank += plan(index, targets_of(tensors, mine), worker).bytes_per_rank(8)
    assert per_rank.max() / per_rank.mean() <= 1.1
    assert per_rank.sum() == 8 * (6 * 64 * 12 + 48) * 2


# -- DTensor boxes, as torch computes them ---------------------------------------------


def _torch_placements(placements):
    return [Shard(p[1]) if p[0] == "shard" else Replicate() for p in placements]


@st.composite
def dtensors(draw):
    shape = draw(st.lists(st.integers(0, 11), min_size=1, max_size=3))
    mesh = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    placements = [
        draw(st.sampled_from([("replicate",), *[("shard", d) for d in range(len(shape))]]))
        for _ in mesh
    ]
    return shape, mesh, placements


@settings(max_examples=300, deadline=None)
@given(dtensors())
def test_dtensor_boxes_are_torch_s_for_every_mesh_coordinate(case):
    shape, mesh, placements = case
    start, size = dtensor_boxes(shape, mesh, placements)
    coords = np.indices(mesh).reshape(len(mesh), -1).T
    for i, coord in enumerate(coords.tolist()):
        want = _compute_local_shape_and_global_offset(
            shape, mesh, coord, _torch_placements(placements)
        )
        assert (tuple(size[i].tolist()), tuple(start[i].tolist())) == want, coord


def test_two_mesh_dims_sharding_one_tensor_dim_nest_unevenly():
    # torch's own docstring example: (2, 5) on a 2 x 2 mesh, (Shard(1), Shard(1)).
    start, size = dtensor_boxes((2, 5), (2, 2), [("shard", 1), ("shard", 1)])
    assert start.tolist() == [[0, 0], [0, 2], [0, 3], [0, 4]]
    assert size.tolist() == [[2, 2], [2, 1], [2, 1], [2, 1]]
    # 5 rows over 4: chunks of 2, the last coordinate holds nothing and starts at 5.
    start, size = dtensor_boxes((5,), (4,), [("shard", -1)])
    assert (start.ravel().tolist(), size.ravel().tolist()) == ([0, 2, 4, 5], [2, 2, 1, 0])
    one, _ = dtensor_boxes((5,), (4,), [("shard", 0)], coords=[[2]])
    assert one.tolist() == [[4]]


@pytest.mark.parametrize(
    "shape, mesh, placements",
    [
        ((7, 10), (2, 3), [("shard", 0), ("shard", 1)]),
        ((10, 3), (2, 3), [("shard", 0), ("shard", 0)]),
        ((5, 4), (3, 2), [("replicate",), ("shard", 0)]),
    ],
)
def test_dtensor_boxes_match_torch_on_a_real_device_mesh(shape, mesh, placements):
    start, size = dtensor_boxes(shape, mesh, placements)
    world = int(np.prod(mesh))
    for rank in range(world):  # each rank's view, through a fake process group
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            device_mesh = DeviceMesh("cpu", np.arange(world).reshape(mesh).tolist())
            got = compute_local_shape_and_global_offset(
                shape, device_mesh, _torch_placements(placements)
            )
        finally:
            dist.destroy_process_group()
        assert got == (tuple(size[rank].tolist()), tuple(start[rank].tolist()))


def test_other_placements_are_refused():
    for bad in [("partial",), ("shard", 2), ("strided_shard", 0, 2)]:
        with pytest.raises(ValueError, match="give"):
            dtensor_boxes((4, 4), (2,), [bad])
    with pytest.raises(ValueError, match="2 placements for a mesh of 1"):
        dtensor_boxes((4, 4), (2,), [("replicate",), ("replicate",)])


# -- the smaller helpers ---------------------------------------------------------------


def test_agree_names_tensors_whose_ranks_disagree():
    agreed, problems = agree(
        [0, 1, 0, 1, 2], [0, 0, 3, 1, 2], [[8, 4], [3, 3], [8, 5], [3, 3], [1, 9]], 4
    )
    assert agreed.tolist() == [[8, 4], [3, 3], [1, 9], [0, 0]]
    assert problems == {
        0: ["ranks disagree on its global shape: rank 0 has (8, 4), rank 3 has (8, 5)"]
    }
    _, dtypes = agree([0, 0], [0, 1], [[2], [4]], 1, what="item size")
    assert dtypes == {0: ["ranks disagree on its item size: rank 0 has (2,), rank 1 has (4,)"]}
    with pytest.raises(ValueError, match=r"0\.\.3"):
        agree([4], [0], [[1]], 4)


def test_pack_lays_each_group_back_to_back_aligned():
    assert pack([0, 1, 0, 1, 0], [3, 5, 8, 1, 2]).tolist() == [0, 0, 3, 5, 11]
    assert pack([0, 1, 0, 1, 0], [3, 5, 8, 1, 2], align=4).tolist() == [0, 0, 4, 8, 12]
    with pytest.raises(ValueError, match="more than 2 dims"):
        pad([(1, 2, 3)], 2)


def test_layouts_are_equal_and_hashed_by_content():
    tensors = tensors_of([(8, 4)])
    a = sources_of(tensors, [(0, 0, (0, 0), (8, 4))])
    b = sources_of(tensors, [(0, 0, (0, 0), (8, 4))])
    c = sources_of(tensors, [(0, 1, (0, 0), (8, 4))])
    assert a == b and hash(a) == hash(b) and a.key == b.key
    assert a != c and a.key != c.key
    cache = {(tensors, a): "plan"}
    assert cache[(tensors_of([(8, 4)]), b)] == "plan"
    assert index_sources(tensors, a).key == index_sources(tensors, b).key
