"""Layouts as boxes: the numpy columns the resharding planner (``_plan``) takes.

A layout says, for tensors numbered ``0..T-1``, which box of each global tensor a
process holds and where its bytes lie. Every box is padded to ``D`` dims (leading
``start`` 0, ``shape`` 1), one row per box, so that a layout of a million boxes is a
handful of int64 arrays, not a million objects. ``Tensors`` holds what the ranks
agree on (global shape, item size); ``Sources`` what each trainer rank holds;
``Targets`` what one worker holds. All three are equal and hashed by content, with
a digest ``key`` to cache plans by.

Making them: ``dtensor_boxes`` turns DTensor placements (as plain data: no torch
here) into every rank's box, as torch computes it; ``pack`` lays a rank's pieces back
to back in its buffer; ``pad`` turns shape tuples into rows; ``agree`` checks that
the ranks agree on each tensor's global shape (or dtype) and names those that do not.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import cached_property

import numpy as np

I64 = np.int64
Problems = dict[int, list[str]]  # tensor number -> what is wrong with its boxes


def _vec(a: object) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(a, dtype=I64).reshape(-1))


def _mat(a: object, rows: int) -> np.ndarray:
    m = np.asarray(a, dtype=I64)
    return np.ascontiguousarray(m if m.ndim == 2 else m.reshape(rows, -1 if rows else 0))


class _Columns:
    """Columns as contiguous int64 arrays, equal and hashed by content: ``key`` is a
    digest of every column, computed once (about 0.1 s per million rows)."""

    def _normalise(self, matrices: Sequence[str], offsets: Sequence[str]) -> None:
        names = [f.name for f in fields(self)]  # type: ignore[arg-type]
        rows = len(np.asarray(getattr(self, names[0])).reshape(-1))
        for name in names:
            value = getattr(self, name)
            column = _mat(value, rows) if name in matrices else _vec(value)
            if len(column) != rows:
                raise ValueError(f"column {name!r} has {len(column)} rows, not {rows}")
            if name in offsets and (column < 0).any():
                raise ValueError(f"column {name!r} holds negative values")
            object.__setattr__(self, name, column)

    @cached_property
    def key(self) -> bytes:
        digest = hashlib.blake2b(digest_size=16)
        for f in fields(self):  # type: ignore[arg-type]
            column = getattr(self, f.name)
            digest.update(repr(column.shape).encode())
            digest.update(column)
        return digest.digest()

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)


@dataclass(frozen=True, eq=False)
class Tensors(_Columns):
    """Per tensor ``0..T-1``: ``itemsize`` in bytes and ``global_shape`` (T, D).
    ``ValueError`` if the lengths differ, an item size is not positive or an extent
    is negative."""

    itemsize: np.ndarray
    global_shape: np.ndarray

    def __post_init__(self) -> None:
        self._normalise(("global_shape",), ("global_shape",))
        if (self.itemsize < 1).any():
            raise ValueError("column 'itemsize' holds sizes below 1 byte")


@dataclass(frozen=True, eq=False)
class Sources(_Columns):
    """What the source ranks hold, one row per piece: ``tensor``, ``rank``, the box
    ``start``/``shape`` (n, D) in the global tensor, and where its bytes lie: in
    tensor ``index`` of that rank's published object, from byte ``base``, row-major
    over the box. A rank holding a tensor as several contiguous blocks lists each
    block; a replicated box is listed once per rank that holds it. ``ValueError`` if
    the columns' lengths differ or ``index``/``base`` are negative."""

    tensor: np.ndarray
    rank: np.ndarray
    start: np.ndarray
    shape: np.ndarray
    index: np.ndarray
    base: np.ndarray

    def __post_init__(self) -> None:
        self._normalise(("start", "shape"), ("index", "base"))


@dataclass(frozen=True, eq=False)
class Targets(_Columns):
    """What one worker holds, one row per piece: ``tensor``, its box ``start``/``shape``
    (n, D), and where it lands: destination ``dest`` (any integer id) from byte
    ``dest_base``, row-major over the box. ``ValueError`` if the columns' lengths
    differ or ``dest_base`` is negative."""

    tensor: np.ndarray
    start: np.ndarray
    shape: np.ndarray
    dest: np.ndarray
    dest_base: np.ndarray

    def __post_init__(self) -> None:
        self._normalise(("start", "shape"), ("dest_base",))


def pad(shapes: Sequence[Sequence[int]], ndim: int, fill: int = 1) -> np.ndarray:
    """``shapes`` (or starts, with ``fill=0``) as an (n, ndim) int64 array, each padded
    with leading ``fill``; ``ValueError`` if one has more than ``ndim`` dims."""
    out = np.full((len(shapes), ndim), fill, dtype=I64)
    for i, s in enumerate(shapes):  # the caller's own tuples, once per layout
        if len(s) > ndim:
            raise ValueError(f"shape {tuple(s)} has more than {ndim} dims")
        out[i, ndim - len(s) :] = s
    return out


def pack(group: np.ndarray, nbytes: np.ndarray, align: int = 1) -> np.ndarray:
    """Byte offsets laying items back to back within each ``group`` (a rank's flat
    buffer, say) in the order given, each offset a multiple of ``align``."""
    group, nbytes = _vec(group), _vec(nbytes)
    sized = -(-nbytes // align) * align
    order = np.argsort(group, kind="stable")
    before = np.cumsum(sized[order]) - sized[order]
    flags = run_flags(group[order])
    out = np.empty_like(nbytes)
    out[order] = before - before[flags][np.cumsum(flags) - 1]
    return out


def dtensor_boxes(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[tuple[str] | tuple[str, int]],
    coords: np.ndarray | Sequence[Sequence[int]] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The boxes (start, shape), each (n, ndim), that mesh coordinates hold of a
    DTensor, as torch's ``compute_local_shape_and_global_offset`` computes them.

    ``placements`` has one entry per mesh dim: ``("shard", dim)`` or
    ``("replicate",)``. ``coords`` (n, mesh dims) defaults to every coordinate in
    row-major order (the order of the mesh's flattened rank tensor). Mesh dims apply
    left to right, each splitting what the previous ones left as ``torch.chunk`` does
    (chunks of ceil(size / n), so trailing coordinates may get less, or nothing): mesh
    dims sharding one tensor dim nest. An empty shard starts at the dim's global
    extent, as in torch. ``ValueError`` for another placement (``Partial``,
    ``_StridedShard``) or a mesh of another length."""
    shape = _vec(global_shape)
    if len(placements) != len(mesh_shape):
        raise ValueError(f"{len(placements)} placements for a mesh of {len(mesh_shape)} dims")
    if coords is None:
        coords = np.indices(tuple(mesh_shape)).reshape(len(mesh_shape), -1).T
    coords = _mat(coords, len(coords))
    size = np.repeat(shape[None, :], len(coords), 0)
    start = np.zeros_like(size)
    for m, placement in enumerate(placements):
        if tuple(placement) == ("replicate",):
            continue
        if (
            len(placement) != 2
            or placement[0] != "shard"
            or not -len(shape) <= placement[1] < len(shape)
        ):
            raise ValueError(f"placement {placement!r}: give ('shard', dim) or ('replicate',)")
        d = int(placement[1]) % len(shape)
        chunk = -(-size[:, d] // mesh_shape[m])
        begin = chunk * coords[:, m]
        part = np.clip(np.minimum(size[:, d], begin + chunk) - begin, 0, None)
        start[:, d] = np.where(part > 0, start[:, d] + begin, shape[d])
        size[:, d] = part
    return start, size


def agree(
    tensor: object, rank: object, values: object, n_tensors: int, what: str = "global shape"
) -> tuple[np.ndarray, Problems]:
    """Per tensor, what its ranks say of it: ``values`` (n, k) has one row per
    (``tensor``, ``rank``) claim, a global shape or a dtype code. Returns each
    tensor's first claim as (n_tensors, k) (zeros where none) and the tensors whose
    ranks disagree, e.g. "ranks disagree on its global shape: rank 0 has (8, 4),
    rank 3 has (8, 5)". ``ValueError`` for a tensor outside 0..n_tensors-1."""
    tensor, rank = _vec(tensor), _vec(rank)
    values = _mat(values, len(tensor))
    if len(tensor) and (tensor.min() < 0 or tensor.max() >= n_tensors):
        raise ValueError(f"tensor numbers must lie in 0..{n_tensors - 1}")
    order = np.argsort(tensor, kind="stable")
    flags = run_flags(tensor[order])
    first = order[flags][np.cumsum(flags) - 1]  # per sorted row: its tensor's first row
    agreed = np.zeros((n_tensors, values.shape[1]), I64)
    agreed[tensor[first]] = values[first]
    problems: Problems = {}
    wrong = (values[order] != values[first]).any(1)
    for at in np.flatnonzero(wrong)[first_each(tensor[order][wrong])]:
        a, b = first[at], order[at]
        claims = [f"rank {rank[i]} has {tuple(values[i].tolist())}" for i in (a, b)]
        problems[int(tensor[b])] = [f"ranks disagree on its {what}: {', '.join(claims)}"]
    return agreed, problems


def row_major(shape: np.ndarray) -> np.ndarray:
    """Element strides of row-major boxes of ``shape`` (n, D)."""
    strides = np.ones_like(shape)
    for d in range(shape.shape[1] - 2, -1, -1):
        strides[:, d] = strides[:, d + 1] * shape[:, d + 1]
    return strides


def _lead(global_shape: np.ndarray) -> int:
    # Leading dims of extent 1 are padding, as a rule: messages start after them.
    real = np.flatnonzero(global_shape != 1)
    return min(int(real[0]) if len(real) else len(global_shape), len(global_shape) - 1)


def box_text(global_shape: np.ndarray, start: np.ndarray, shape: np.ndarray) -> str:
    """A box as slices, e.g. "[0:4, 2:8]", for messages."""
    pairs = zip(start[_lead(global_shape) :], shape[_lead(global_shape) :], strict=True)
    return "[" + ", ".join(f"{a}:{a + b}" for a, b in pairs) + "]"


def outside(problems: Problems, tensors: Tensors, boxes: Sources | Targets) -> np.ndarray:
    """Which ``boxes`` name no tensor or do not lie inside its global shape; noted in
    ``problems``, one message per tensor. ``ValueError`` if the boxes do not have the
    tensors' number of dims."""
    if boxes.start.shape[1] != tensors.global_shape.shape[1]:
        dims, ndim = boxes.start.shape[1], tensors.global_shape.shape[1]
        raise ValueError(f"boxes of {dims} dims for tensors of {ndim}: pad both to one D")
    known = (boxes.tensor >= 0) & (boxes.tensor < len(tensors.itemsize))
    limit = tensors.global_shape[np.where(known, boxes.tensor, 0)]
    bad = ~known | across(np.logical_or, (boxes.start < 0) | (boxes.shape < 0))
    bad |= across(np.logical_or, boxes.start + boxes.shape > limit)
    rows = np.flatnonzero(bad)
    firsts = rows[first_each(boxes.tensor[rows])]
    counts = np.bincount(np.searchsorted(boxes.tensor[firsts], boxes.tensor[rows]))
    for i, many in zip(firsts, counts, strict=True):
        who = f"rank {boxes.rank[i]}'s box" if isinstance(boxes, Sources) else "target box"
        shape = tuple(limit[i][_lead(limit[i]) :].tolist())
        where = f"its global shape {shape}" if known[i] else "any tensor's"
        what = f"{who} {box_text(limit[i], boxes.start[i], boxes.shape[i])} lies outside {where}"
        also = f" ({many} such)" if many > 1 else ""
        problems.setdefault(int(boxes.tensor[i]), []).append(what + also)
    return bad


def across(ufunc: np.ufunc, a: np.ndarray) -> np.ndarray:
    """``ufunc`` over each row of ``a`` (n, D): a loop over its few columns, several
    times faster than ``ufunc.reduce(a, axis=1)`` when D is small."""
    return functools.reduce(ufunc, a.T)


def run_flags(sorted_keys: np.ndarray) -> np.ndarray:
    """True where a run of equal keys starts."""
    flags = np.ones(len(sorted_keys), bool)
    flags[1:] = sorted_keys[1:] != sorted_keys[:-1]
    return flags


def first_each(keys: np.ndarray) -> np.ndarray:
    """Positions of each distinct key's first occurrence, in key order (``np.unique``
    with ``return_index`` is many times slower on large arrays here)."""
    order = np.argsort(keys, kind="stable")
    return order[run_flags(keys[order])]
