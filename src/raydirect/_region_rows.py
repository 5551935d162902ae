"""A region read's rows, checked against both sides and merged where they touch.

A row is ``(tensor, offset, length, dest, dest_offset)``: ``length`` bytes from
byte ``offset`` of the region's tensor ``tensor`` into byte ``dest_offset`` of
destination ``dest``. A KV cache read is thousands of them (a run per layer and
block), so everything here is numpy over columns, no Python loop per row:
checked against the region's tensor sizes and the destinations' before a byte
moves, empty rows dropped, and rows that continue one another on both sides
(the next block of a layer landing in the next block of the destination)
merged into one, so a transport sees fewer, longer runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import numpy as np

COLUMNS = ("tensor", "offset", "length", "dest", "dest_offset")
_INT64_MAX = np.iinfo(np.int64).max
_SORTED_IN_PYTHON = 512  # rows; more are sorted by numpy, which lets the GIL go (_order)


def checked_rows(
    rows: Any, sources: Sequence[int], dests: Sequence[int], addresses: Sequence[int]
) -> np.ndarray:
    """``rows`` as an ``(n, 5)`` int64 table, checked (``ValueError``/``TypeError``
    naming the first bad row), empty rows dropped, sorted by where they read and
    merged where they touch on both sides. ``sources``: the region's tensor sizes
    in bytes; ``dests``: the destinations'; ``addresses``: where each destination
    starts in memory."""
    table = _table(rows)
    src, dst = np.asarray(sources, np.int64), np.asarray(dests, np.int64)
    if _out_of_bounds(table, src, dst):
        _check_bounds(table, src, dst)  # only now: which row, and why
    kept = np.flatnonzero(table[:, 2] > 0)
    if len(kept) < len(table):
        table = _rows(table, kept)
    shared = _share_memory(addresses, dests)
    _check_no_overlap(table, kept, np.asarray(addresses, np.int64) if shared else None)
    return _merged(table)


def _table(rows: Any) -> np.ndarray:
    array = np.asarray(rows)
    if array.size == 0:
        return np.zeros((0, len(COLUMNS)), np.int64)
    if array.ndim != 2 or array.shape[1] != len(COLUMNS):
        raise ValueError(
            f"rows must be an (n, 5) table of {', '.join(COLUMNS)}; got shape {array.shape}"
        )
    if array.dtype.kind not in "iu":
        raise TypeError(
            f"rows must be whole numbers (an integer array or lists of ints), got {array.dtype}"
        )
    if array.dtype.kind == "u" and int(array.max()) > _INT64_MAX:
        raise ValueError("a row holds a number past 2**63")
    return np.asarray(array, dtype=np.int64)  # no copy of an int64 table


def _key(high: np.ndarray, low: np.ndarray) -> np.ndarray | None:
    """One int64 sort key ordering rows by (high, low), where both fit; else None."""
    if len(low) and (int(low.max()) >= 1 << 40 or int(high.max()) >= 1 << 22):
        return None
    return (high << 40) | low


def _order(high: np.ndarray, low: np.ndarray) -> np.ndarray | slice:
    """Rows in (high, low) order: all of them (``slice(None)``) when they are
    already, as a KV read's usually are. numpy's sorts (and its fancy indexing
    of 2-D tables, ``_rows``) let the GIL go, and a reader beside a thread that
    runs Python (a vLLM worker's loop) then waits up to the switch interval,
    5 ms, to have it back: such a wait costs a read more than its bytes."""
    key = _key(high, low)
    if key is None:
        return np.lexsort((low, high))
    if len(key) < 2 or bool((key[1:] >= key[:-1]).all()):
        return slice(None)
    if len(key) <= _SORTED_IN_PYTHON:  # 5-40 us, holding the GIL
        keys = key.tolist()
        return np.array(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)
    return np.argsort(key, kind="stable")


def _rows(table: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``table[index]`` a column at a time: numpy's fancy indexing of a 2-D table
    lets the GIL go (see ``_order``), of a column it does not."""
    return np.stack([table[:, i][index] for i in range(table.shape[1])], 1)


def _out_of_bounds(table: np.ndarray, sources: np.ndarray, dests: np.ndarray) -> bool:
    """Whether any row is out of bounds (one pass; ``_check_bounds`` says which)."""
    if not len(table):
        return False
    low = table.min(0)
    if (low < 0).any() or table[:, 0].max() >= len(sources) or table[:, 3].max() >= len(dests):
        return True
    tensor, offset, length, dest, at = table.T
    return bool((offset > sources[tensor] - length).any() or (at > dests[dest] - length).any())


def _first(bad: np.ndarray, table: np.ndarray, what: str) -> None:
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"row {i} {table[i].tolist()} ({', '.join(COLUMNS)}): {what}")


def _check_bounds(table: np.ndarray, sources: np.ndarray, dests: np.ndarray) -> None:
    tensor, offset, length, dest, at = table.T
    _first((tensor < 0) | (tensor >= len(sources)), table, f"the region has {len(sources)} tensors")
    _first((dest < 0) | (dest >= len(dests)), table, f"there are {len(dests)} destinations")
    _first((offset < 0) | (length < 0) | (at < 0), table, "a negative offset or length")
    _first(
        offset > sources[tensor] - length,  # no overflow: both at most 2**63 - 1
        table,
        f"reaches past the end of the region's tensor (sizes: {_shown(sources)} bytes)",
    )
    _first(
        at > dests[dest] - length,
        table,
        f"reaches past the end of its destination (sizes: {_shown(dests)} bytes)",
    )


def _shown(sizes: np.ndarray) -> str:
    listed = ", ".join(str(n) for n in sizes[:8].tolist())
    return listed + (", ..." if len(sizes) > 8 else "")


def _check_no_overlap(table: np.ndarray, ids: np.ndarray, bases: np.ndarray | None) -> None:
    """Refuse rows writing the same destination bytes: reads run concurrently,
    and which one would land last is not defined. By destination and offset; by
    address where destinations share memory (``bases``: where each starts)."""
    if bases is None:
        order = _order(table[:, 3], table[:, 4])
        dest, at = table[:, 3][order], table[:, 4][order]
        clash = dest[1:] == dest[:-1]
    else:
        where = bases[table[:, 3]] + table[:, 4]
        order = np.argsort(where, kind="stable")
        dest, at = table[:, 3][order], where[order]
        clash = np.ones(max(len(at) - 1, 0), bool)  # one memory: any two may overlap
    length = table[:, 2][order]
    clash &= at[1:] < at[:-1] + length[:-1]
    if clash.any():
        k = int(np.flatnonzero(clash)[0])
        rows = np.arange(len(table))[order]
        a, b = sorted((int(ids[rows[k]]), int(ids[rows[k + 1]])))
        first, second = int(dest[k]), int(dest[k + 1])
        where_said = (
            f"of destination {first}: give each byte of a destination one row"
            if first == second
            else f"through destinations {first} and {second}, which share memory: give each "
            "byte one row"
        )
        raise ValueError(f"rows {a} and {b} write the same bytes {where_said}")


def _share_memory(addresses: Sequence[int], sizes: Sequence[int]) -> bool:
    """Whether two destinations share a byte (one tensor given twice, or two
    views of one buffer that overlap): rows into them may then write one byte
    through two destinations, which the check by destination does not see.
    Sorted in Python, as ``_order`` sorts a few rows: a KV read has a
    destination per layer, and numpy's sort would let the GIL go."""
    spans = sorted((a, n) for a, n in zip(addresses, sizes, strict=True) if n > 0)
    return any(b < a + n for (a, n), (b, _) in pairwise(spans))


def _merged(table: np.ndarray) -> np.ndarray:
    """Sorted by (tensor, offset); each run of rows that continue one another on
    both sides becomes one row."""
    if len(table) < 2:
        return table
    order = _order(table[:, 0], table[:, 1])
    if not isinstance(order, slice):
        table = _rows(table, order)
    tensor, offset, length, dest, at = table.T
    joins = (
        (tensor[1:] == tensor[:-1])
        & (offset[1:] == offset[:-1] + length[:-1])
        & (dest[1:] == dest[:-1])
        & (at[1:] == at[:-1] + length[:-1])
    )
    if not joins.any():
        return table
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    lasts = np.append(starts[1:], len(table)) - 1
    merged = _rows(table, starts)
    # Not np.add.reduceat, which lets the GIL go (see _order): the rows of a run
    # are back to back, so its length is where its last row ends.
    merged[:, 2] = offset[lasts] + length[lasts] - offset[starts]
    return merged
