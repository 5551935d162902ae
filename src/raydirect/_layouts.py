"""Weight sync's shared vocabulary: what a published version looks like, and where
each tensor of a rank, or of a worker, lies in its global tensor.

The publisher (``_weights``) writes ``WeightsLayout`` and ``WeightsHandle``; the
subscriber (``_subscriber``) reads them and hands the planner (``_plan``) boxes:
this module is what both share, so that a load never climbs into the
publisher's module. A tensor's box in its global tensor comes from a DTensor's
placements (``Shard(d)`` and ``Replicate()`` on a mesh of any number of dims) or
from a ``placement``/``shard`` function; a tensor a rank stores as several blocks
(``shard_blocks``) is one piece per block (``pieces``).
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import ray
import torch

from raydirect import _boxes as boxes
from raydirect import _compression as compression
from raydirect._plan import SourceIndex, index_sources
from raydirect._tensors import torch_dtype
from raydirect.errors import WeightSyncError

# ------------------------------------------------------------ sources and targets


def state_of(source: Any, what: str) -> dict[str, torch.Tensor]:
    """The named tensors of an ``nn.Module`` (its ``state_dict()``, sharing the
    parameters' memory) or of a ``dict[str, Tensor]``."""
    if isinstance(source, torch.nn.Module):
        # keep_vars: the parameters themselves, not new detached tensors each call,
        # so that rd.wait_tensor_freed(param) sees what a depth=0 version holds.
        return dict(source.state_dict(keep_vars=True))
    if isinstance(source, Mapping):
        state = dict(source)
        for name, tensor in state.items():
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"{what} maps {name!r} to a {type(tensor).__name__}; give a dict of "
                    "str -> torch.Tensor, or an nn.Module"
                )
        return state
    raise TypeError(
        f"{what} must be an nn.Module or a dict of tensors, got {type(source).__name__}"
    )


def _dtensor_module() -> Any:
    # Only when the program imported it (it made DTensors): importing it costs 0.5 s.
    return sys.modules.get("torch.distributed.tensor")


def is_dtensor(tensor: Any) -> bool:
    module = _dtensor_module()
    return module is not None and isinstance(tensor, module.DTensor)


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """The memory this process holds of ``tensor``: a DTensor's local shard, else itself."""
    if is_dtensor(tensor):
        return tensor.to_local().detach()  # type: ignore[attr-defined]
    return tensor


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (global shape, start of the local box)


def dtensor_box(name: str, tensor: Any) -> Box:
    """Where a DTensor's local shard lies in its global tensor, from its placements
    and this process's mesh coordinate. ``WeightSyncError`` naming the tensor for a
    placement other than ``Shard(d)`` and ``Replicate()`` (``Partial`` holds no
    slice of the values; ``_StridedShard`` interleaves them)."""
    module = _dtensor_module()
    placements: list[tuple[str] | tuple[str, int]] = []
    for p in tensor.placements:
        if type(p) is module.Shard:
            placements.append(("shard", int(p.dim)))
        elif type(p) is module.Replicate:
            placements.append(("replicate",))
        else:
            raise WeightSyncError(
                f"{name!r} is a DTensor placed as {p!r}: weight sync reads Shard(dim) and "
                "Replicate() placements only; redistribute it (full_tensor(), or "
                "redistribute(placements=[Shard(0)])) before publishing"
            )
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    global_shape = tuple(int(n) for n in tensor.shape)
    if coordinate is None:
        raise WeightSyncError(f"{name!r}: this process is not in the DTensor's device mesh")
    start, _ = boxes.dtensor_boxes(global_shape, tuple(mesh.shape), placements, [coordinate])
    return global_shape, tuple(int(v) for v in start[0])


def placed_box(name: str, local_shape: tuple[int, ...], spec: Any) -> Box | None:
    """What a ``placement(name, local_shape)`` function said: None (the whole
    tensor), or ``(global_shape, dim, start)`` checked against ``local_shape``."""
    if spec is None:
        return None
    try:
        global_shape, dim, start = spec
        global_shape = tuple(int(n) for n in global_shape)
        dim, start = int(dim), int(start)
    except (TypeError, ValueError):
        raise WeightSyncError(
            f"{name!r}: placement returned {spec!r}; return None (this rank holds the whole "
            "tensor) or (global_shape, dim, start)"
        ) from None
    fits = len(global_shape) == len(local_shape) and 0 <= dim < len(local_shape)
    fits = fits and all(
        g == n for d, (g, n) in enumerate(zip(global_shape, local_shape, strict=True)) if d != dim
    )
    if not fits or not 0 <= start <= start + local_shape[dim] <= global_shape[dim]:
        raise WeightSyncError(
            f"{name!r}: placement {(global_shape, dim, start)} does not fit the local shape "
            f"{local_shape}: the local tensor must be [start, start + its size) along dim "
            "`dim` of the global shape, and equal to it along every other dim"
        )
    starts = [0] * len(local_shape)
    starts[dim] = start
    return global_shape, tuple(starts)


# ------------------------------------------------------------ what a version looks like


@dataclass(frozen=True)
class WeightsLayout:
    """Where each named tensor of a published version lies: tensor ``index[i]``
    of the published object, from byte ``offsets[i]``. The same for every
    version of one publisher until its weights change shape. A rank of a sharded
    trainer holds part of each tensor: ``shapes`` are its local shapes,
    ``global_shapes`` and ``starts`` say where they lie (empty: each is whole)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    index: tuple[int, ...]
    offsets: tuple[int, ...]
    device: str
    token: bytes  # identifies the layout: subscribers cache their plans by it
    # Per tensor, None or (dim, parts): stored as ``parts`` contiguous blocks along
    # ``dim`` (block k: the slice [k * size / parts, (k + 1) * size / parts)).
    blocks: tuple[tuple[int, int] | None, ...] = ()
    # Per tensor, the bytes from the start of one block to the next (blocked tensors).
    block_strides: tuple[int, ...] = ()
    global_shapes: tuple[tuple[int, ...], ...] = ()
    starts: tuple[tuple[int, ...], ...] = ()

    def block_of(self, i: int) -> tuple[int, int] | None:
        return self.blocks[i] if self.blocks else None

    def block_stride(self, i: int) -> int:
        return self.block_strides[i]

    def global_shape(self, i: int) -> tuple[int, ...]:
        return self.global_shapes[i] if self.global_shapes else self.shapes[i]

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return (_layout_from, (self.packed(),))

    def packed(self) -> bytes:
        """The fields as one blob, compressed (5,000 names and shapes: 300 KB raw,
        20-30 KB packed), so that a handle, which carries its layout, stays under
        Ray's inline limit instead of going through its object store."""
        fields = tuple(getattr(self, f.name) for f in dataclasses.fields(self))
        return compression.pack(pickle.dumps(fields, pickle.HIGHEST_PROTOCOL))

    @property
    def nbytes(self) -> int:
        return sum(nbytes_of(s, d) for s, d in zip(self.shapes, self.dtypes, strict=True))

    @cached_property
    def pieces(self) -> Pieces:
        """This rank's pieces, a block each for blocked tensors (see ``Pieces``)."""
        return Pieces.of(self)


@dataclass(frozen=True)
class Pieces:
    """A layout's pieces as columns: piece j is (part of) tensor ``tensor[j]`` (its
    position in the layout), the box ``start[j]``/``shape[j]`` of the global tensor
    (unpadded rows of each tensor's own number of dims, in ``ndim``), stored row-major
    in tensor ``index[j]`` of the published object from byte ``base[j]``."""

    tensor: np.ndarray
    start: list[tuple[int, ...]]
    shape: list[tuple[int, ...]]
    index: np.ndarray
    base: np.ndarray

    @classmethod
    def of(cls, layout: WeightsLayout) -> Pieces:
        tensor, start, shape, index, base = [], [], [], [], []
        for i, local in enumerate(layout.shapes):
            at = layout.starts[i] if layout.starts else (0,) * len(local)
            block = layout.block_of(i)
            if block is None:
                tensor.append(i)
                start.append(at)
                shape.append(local)
                index.append(layout.index[i])
                base.append(layout.offsets[i])
                continue
            dim, parts = block
            size = local[dim] // parts
            one = (*local[:dim], size, *local[dim + 1 :])
            for k in range(parts):  # blocked tensors are few: a loop per block is fine
                tensor.append(i)
                start.append((*at[:dim], at[dim] + k * size, *at[dim + 1 :]))
                shape.append(one)
                index.append(layout.index[i])
                base.append(layout.offsets[i] + k * layout.block_stride(i))
        as_array = np.asarray
        return cls(
            as_array(tensor, np.int64),
            start,
            shape,
            as_array(index, np.int64),
            as_array(base, np.int64),
        )


def _layout_from(blob: bytes) -> WeightsLayout:
    return WeightsLayout(*pickle.loads(compression.unpack(blob)))


def _handle_from(version: int, token: bytes, packed: bytes, ref: ray.ObjectRef) -> WeightsHandle:
    """A handle as it arrives: its layout still packed (see ``WeightsHandle``)."""
    handle = WeightsHandle.__new__(WeightsHandle)
    handle.version, handle.ref, handle.layout_token = version, ref, token
    handle._layout, handle._packed = None, packed
    return handle


def nbytes_of(shape: Sequence[int], dtype: str) -> int:
    return math.prod(shape) * torch.empty((), dtype=torch_dtype(dtype)).element_size()


class WeightsHandle:
    """One published version (of one rank, for a sharded trainer): small,
    picklable, and travels wherever a ref goes (returned from a method, nested in
    lists, borrowed). Holding it keeps the version's slot from reuse.

    A handle that arrived from another process decodes its layout on first use
    (``layout``): a subscriber whose plan for ``layout_token`` is made already
    never does (a handle of 5,000 tensors then arrives in 0.01 ms instead of
    1.6 ms, per rank and step; a 4-way sharded load of them takes about 14 ms)."""

    __slots__ = ("version", "ref", "layout_token", "_layout", "_packed")

    def __init__(self, version: int, layout: WeightsLayout, ref: ray.ObjectRef) -> None:
        self.version, self.ref, self.layout_token = version, ref, layout.token
        self._layout: WeightsLayout | None = layout
        self._packed: bytes | None = None

    @property
    def layout(self) -> WeightsLayout:
        if self._layout is None:
            assert self._packed is not None
            self._layout = _layout_from(self._packed)
        return self._layout

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        packed = self._packed if self._packed is not None else self.layout.packed()
        return (_handle_from, (self.version, self.layout_token, packed, self.ref))

    def __repr__(self) -> str:
        return f"WeightsHandle(version={self.version}, ref={self.ref!r})"

    @property
    def names(self) -> tuple[str, ...]:
        return self.layout.names

    @property
    def nbytes(self) -> int:
        """Bytes of the whole version (a sharded load moves fewer)."""
        return self.layout.nbytes


# ------------------------------------------------------------ what the ranks publish


@dataclass
class Published:
    """What a set of ranks' layouts publish: tensors numbered by name, the global
    shape and dtype the ranks agree on, and their boxes grouped and checked."""

    names: list[str]
    number: dict[str, int]
    dtypes: list[str]
    global_shapes: list[tuple[int, ...]]
    device: str
    index: SourceIndex
    problems: dict[int, list[str]]  # where the ranks disagree (a global shape, a dtype)

    @classmethod
    def of(cls, layouts: Sequence[WeightsLayout]) -> Published:
        devices = {layout.device for layout in layouts}
        if len(devices) > 1:
            raise WeightSyncError(
                f"the ranks publish from several device types {sorted(devices)}; "
                "nothing was written"
            )
        number: dict[str, int] = {}
        for layout in layouts:
            for name in layout.names:
                number.setdefault(name, len(number))
        claims = _Claims.of(layouts, number)
        shapes, disagree = boxes.agree(claims.tensor, claims.rank, claims.shape, len(number))
        codes, wrong = boxes.agree(claims.tensor, claims.rank, claims.dtype, len(number), "dtype")
        for t in wrong:  # say it with the dtypes' names, not their codes
            disagree.setdefault(t, []).append(claims.dtype_disagreement(t))
        dtypes = [claims.dtype_names[c] for c in codes[:, 0].tolist()]
        itemsize = [torch.empty((), dtype=torch_dtype(d)).element_size() for d in dtypes]
        tensors = boxes.Tensors(np.asarray(itemsize, np.int64), shapes)
        sources = boxes.Sources(*_pieces(layouts, number, claims.ndim))
        index = index_sources(tensors, sources)  # its problems: the boxes' own
        global_shapes = [
            tuple(shapes[t, claims.ndim - n :].tolist()) for t, n in enumerate(claims.ndims)
        ]
        return cls(list(number), number, dtypes, global_shapes, devices.pop(), index, disagree)


@dataclass
class _Claims:
    """What each rank says of each tensor it publishes, one row per (rank, tensor)."""

    tensor: np.ndarray
    rank: np.ndarray
    shape: np.ndarray  # global shapes, padded to ``ndim``
    dtype: np.ndarray  # (n, 1) codes into ``dtype_names``
    dtype_names: list[str]
    ndim: int
    ndims: list[int]  # each tensor's own number of dims

    @classmethod
    def of(cls, layouts: Sequence[WeightsLayout], number: dict[str, int]) -> _Claims:
        names = sorted({d for layout in layouts for d in layout.dtypes})
        codes = {d: i for i, d in enumerate(names)}
        tensor: list[int] = []
        rank: list[int] = []
        shapes: list[tuple[int, ...]] = []
        dtype: list[int] = []
        ndims = [1] * len(number)
        for r, layout in enumerate(layouts):
            numbers = [number[n] for n in layout.names]
            tensor.extend(numbers)
            rank.extend([r] * len(numbers))
            mine = [layout.global_shape(i) for i in range(len(numbers))]
            shapes.extend(mine)
            dtype.extend(codes[d] for d in layout.dtypes)
            for t, shape in zip(numbers, mine, strict=True):
                ndims[t] = len(shape)
        ndim = max(ndims, default=1)
        return cls(
            np.asarray(tensor, np.int64),
            np.asarray(rank, np.int64),
            boxes.pad(shapes, ndim),
            np.asarray(dtype, np.int64).reshape(-1, 1),
            names,
            ndim,
            ndims,
        )

    def dtype_disagreement(self, t: int) -> str:
        rows = np.flatnonzero(self.tensor == t)
        first = self.dtype[rows[0], 0]
        other = rows[np.flatnonzero(self.dtype[rows, 0] != first)[0]]
        said = [
            f"rank {self.rank[i]} has {self.dtype_names[self.dtype[i, 0]]}"
            for i in (rows[0], other)
        ]
        return f"ranks disagree on its dtype: {', '.join(said)}"


def _pieces(
    layouts: Sequence[WeightsLayout], number: dict[str, int], ndim: int
) -> tuple[np.ndarray, ...]:
    """Every rank's pieces as ``boxes.Sources`` columns (the rank: its position)."""
    columns: list[list[np.ndarray]] = [[], [], [], [], [], []]
    for r, layout in enumerate(layouts):
        pieces = layout.pieces
        numbers = np.fromiter((number[n] for n in layout.names), np.int64, len(layout.names))
        columns[0].append(numbers[pieces.tensor])
        columns[1].append(np.full(len(pieces.tensor), r, np.int64))
        columns[2].append(boxes.pad(pieces.start, ndim, 0))
        columns[3].append(boxes.pad(pieces.shape, ndim))
        columns[4].append(pieces.index)
        columns[5].append(pieces.base)
    return tuple(np.concatenate(c) for c in columns)
