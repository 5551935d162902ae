"""Weight sync, the publishing side: versioned snapshots of a model's weights.

``WeightPublisher.publish`` copies the current weights into one of ``depth``
slots, a single flat buffer laid out once per model, and exports that buffer as
one raydirect object. However many tensors the model has, a version is one
object: one lease, one metadata record, one read (or one ranged read per
shard) on the consumer's side. The handle carries the layout (names, shapes,
dtypes, byte offsets) and the object's ref.

A slot is reused only when no object holds its buffer any more, that is when
no handle of that version (and no load from it) is alive anywhere: Ray's
reference counting decides, with no call from the consumers. ``depth=0`` makes
no copy: the handle refers to the live tensors (write them in place only after
``rd.wait_tensor_freed``).

``shard_blocks`` lays a tensor out in its slot as blocks along one dimension,
each block contiguous: a row-parallel weight split by columns then gives each
tensor-parallel rank one run of bytes to read instead of one per row. Blocks
are grouped by rank: block k of every blocked tensor (of the same number of
parts) lies in region k of the slot, one after another, so a rank's whole
shard of thousands of tensors is a few long spans of memory, not one short run
per tensor with the other ranks' bytes between.

A sharded trainer publishes from every rank: each rank's publisher holds that
rank's shard of each tensor (a DTensor's local shard, or a plain tensor whose
``placement`` says where it lies) and its handle's layout says where each shard
lies in its global tensor (``_layouts``). Subscribers load from all ranks' handles
at once, each byte from a rank that holds it (``_subscriber``, ``_plan``).
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from raydirect import _ray
from raydirect._collector import collector_paused
from raydirect._layouts import (
    Box,
    WeightsHandle,
    WeightsLayout,
    dtensor_box,
    is_dtensor,
    local_of,
    nbytes_of,
    placed_box,
    state_of,
)
from raydirect._producer import put
from raydirect._split import not_dense
from raydirect._store import store
from raydirect._tensors import DTYPE_NAMES, aligned_offsets, torch_dtype
from raydirect._timeouts import checked_timeout
from raydirect.errors import WeightSyncError
from raydirect.transports.registry import AUTO, check_name

Blocks = Callable[[str, tuple[int, ...]], "tuple[int, int] | None"]
Placement = Callable[[str, tuple[int, ...]], Any]
# Names, shapes and dtypes of a source as a publish saw them.


@dataclass
class _Slot:
    buffer: torch.Tensor  # flat uint8, exported as the version's one tensor
    # One per name, typed, into ``buffer``: shaped as the tensor, or for a blocked
    # tensor as its ``blocked_source`` view (the blocks moved to where they belong).
    views: list[torch.Tensor]


class WeightPublisher:
    """Publishes versions of ``source``'s weights (see the module docstring).

    ``dtype`` casts floating-point tensors at publish (integer and bool buffers
    keep theirs); ``depth`` is how many versions may be alive at once;
    ``tensor_transport`` is how consumers read them (never inline);
    ``shard_blocks(name, shape)`` returns ``None`` or ``(dim, parts)``: that
    tensor is stored as ``parts`` contiguous blocks along ``dim`` (see the module
    docstring). On a rank of a sharded trainer, ``source`` holds this rank's
    shards: DTensor values say where they lie; for plain tensors
    ``placement(name, local_shape)`` returns ``None`` (this rank holds the whole
    tensor: a replica) or ``(global_shape, dim, start)`` (it holds
    ``[start, start + local_shape[dim])`` of ``dim``). Placements other than
    ``Shard(d)`` and ``Replicate()`` are refused here, naming the tensor.
    """

    def __init__(
        self,
        source: Any,
        *,
        dtype: torch.dtype | None = None,
        depth: int = 2,
        tensor_transport: str = AUTO,
        shard_blocks: Blocks | None = None,
        placement: Placement | None = None,
    ) -> None:
        if placement is not None and not callable(placement):
            raise TypeError(
                "placement= is a callable (name, local_shape) -> None | (global_shape, dim, "
                f"start), got {placement!r}"
            )
        self._placement = placement
        state = state_of(source, "source")
        for name, tensor in state.items():  # torch's own errors name no tensor
            kind = not_dense(local_of(tensor))
            if kind is not None:
                raise WeightSyncError(
                    f"{name!r} is {kind}: weight sync moves dense tensors; publish a plain "
                    "dense copy of it (t.to_dense() of a sparse one) or leave it out of the source"
                )
        self._boxes_of(state)  # refuses what cannot be placed, now
        if shard_blocks is not None and (depth == 0 or not callable(shard_blocks)):
            raise ValueError(
                "shard_blocks= is a callable (name, full_shape) -> None | (dim, parts) that "
                "lays tensors out in a slot: it needs depth >= 1"
            )
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype or None, got {dtype!r}")
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            raise ValueError(f"depth must be an int >= 0 (0: no copy), got {depth!r}")
        if depth == 0 and dtype is not None:
            raise ValueError("dtype= casts into a slot: it needs depth >= 1")
        check_name(tensor_transport)
        self._source, self._dtype, self._depth = source, dtype, depth
        self._transport = tensor_transport
        self._blocks = shard_blocks
        self._layout: WeightsLayout | None = None
        self._slots: list[_Slot] = []
        self._last: int | None = None
        self._lock = threading.Lock()

    @property
    def version(self) -> int | None:
        """The last version published."""
        return self._last

    def publish(self, version: int, *, timeout: float | None = None) -> WeightsHandle:
        """Snapshot the weights as ``version`` (greater than the last one) and
        return its handle. Waits up to ``timeout`` for a free slot, then raises
        ``WeightSyncError``. Once it returns, the source may be written in place."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise TypeError(f"version must be an int, got {version!r}")
        timeout = checked_timeout(timeout)
        with self._lock:
            if self._last is not None and version <= self._last:
                raise WeightSyncError(
                    f"version {version} is not newer than the last one published ({self._last})"
                )
            state = state_of(self._source, "source")
            with collector_paused():  # thousands of shapes compared
                layout = self._layout_of(state)
            if self._depth == 0:
                value = self._locals([state[name] for name in layout.names])
            else:
                slot = self._free_slot(layout, timeout)
                sources = self._locals([state[name] for name in layout.names])
                if layout.blocks:
                    sources = [blocked_source(t, layout.block_of(i)) for i, t in enumerate(sources)]
                with torch.no_grad():  # one call for every tensor; casts where dtype= says
                    torch._foreach_copy_(slot.views, sources)
                value = [slot.buffer]
            label = f"{_ray.current_task_label()} publish v{version}"
            ref = put(value, self._transport, label, inline=False)
            self._last = version
        return WeightsHandle(version, layout, ref)

    def _layout_of(self, state: dict[str, torch.Tensor]) -> WeightsLayout:
        names = tuple(state)
        tensors = self._locals(list(state.values()))
        shapes = tuple(tuple(t.shape) for t in tensors)
        dtypes = tuple(self._published_dtype(t) for t in tensors)
        global_shapes: tuple[tuple[int, ...], ...] = ()
        starts: tuple[tuple[int, ...], ...] = ()
        if self._sharded:  # a single-rank publisher pays nothing for this
            placed = self._boxes_of(state)
            global_shapes, starts = tuple(g for g, _ in placed), tuple(a for _, a in placed)
        old = self._layout
        new = (names, shapes, dtypes, global_shapes, starts)
        if old is not None and new == (
            old.names,
            old.shapes,
            old.dtypes,
            old.global_shapes,
            old.starts,
        ):
            return old
        devices = {t.device.type for t in tensors}
        if len(devices) > 1:
            raise WeightSyncError(f"the weights are on several device types {sorted(devices)}")
        blocks = self._blocks_of(names, shapes)
        strides: tuple[int, ...] = ()
        if self._depth == 0:
            index, offsets = tuple(range(len(names))), (0,) * len(names)
        else:
            sizes = [nbytes_of(s, d) for s, d in zip(shapes, dtypes, strict=True)]
            offsets, strides = _slot_offsets(sizes, blocks)
            index = (0,) * len(names)
        self._slots = []  # a new layout: slots of the old one go once their handles do
        device = devices.pop() if devices else "cpu"
        token = secrets.token_bytes(16)
        self._layout = WeightsLayout(
            names,
            shapes,
            dtypes,
            index,
            offsets,
            device,
            token,
            blocks,
            strides,
            global_shapes,
            starts,
        )
        return self._layout

    def _locals(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The memory this rank holds of each: DTensors' local shards."""
        return [local_of(t) for t in tensors] if self._has_dtensors else tensors

    @property
    def _sharded(self) -> bool:
        """Whether this rank's layout says where its shards lie (a placement, or DTensors)."""
        return self._placement is not None or self._has_dtensors

    def _boxes_of(self, state: dict[str, torch.Tensor]) -> list[Box]:
        """Each tensor's global shape and the start of this rank's box in it."""
        self._has_dtensors = any(is_dtensor(t) for t in state.values())
        out: list[Box] = []
        for name, tensor in state.items():
            if is_dtensor(tensor):
                out.append(dtensor_box(name, tensor))
                continue
            shape = tuple(tensor.shape)
            spec = self._placement(name, shape) if self._placement is not None else None
            out.append(placed_box(name, shape, spec) or (shape, (0,) * len(shape)))
        return out

    def _blocks_of(
        self, names: tuple[str, ...], shapes: tuple[tuple[int, ...], ...]
    ) -> tuple[tuple[int, int] | None, ...]:
        if self._blocks is None:
            return ()
        blocks: list[tuple[int, int] | None] = []
        for name, shape in zip(names, shapes, strict=True):
            spec = self._blocks(name, shape)
            if spec is not None:
                try:
                    dim, parts = (int(v) for v in spec)
                except (TypeError, ValueError):
                    raise WeightSyncError(
                        f"{name!r}: shard_blocks returned {spec!r}; return None or (dim, parts)"
                    ) from None
                if not (0 <= dim < len(shape) and parts >= 1 and shape[dim] % parts == 0):
                    raise WeightSyncError(
                        f"{name!r}: shard_blocks {(dim, parts)} does not split shape {shape} "
                        "into equal blocks"
                    )
                spec = None if parts == 1 else (dim, parts)
            blocks.append(spec)
        return tuple(blocks) if any(blocks) else ()

    def _published_dtype(self, tensor: torch.Tensor) -> str:
        dtype = tensor.dtype
        if self._dtype is not None and dtype.is_floating_point:
            dtype = self._dtype
        return DTYPE_NAMES[dtype]

    def _free_slot(self, layout: WeightsLayout, timeout: float | None) -> _Slot:
        for slot in self._slots:
            if not store.holds(slot.buffer):
                return slot
        if len(self._slots) < self._depth:
            self._slots.append(_new_slot(layout))
            return self._slots[-1]
        started = time.monotonic()
        try:
            return self._slots[store.wait_any_freed([s.buffer for s in self._slots], timeout)]
        except TimeoutError:
            raise WeightSyncError(
                f"all {self._depth} slots are still held after {time.monotonic() - started:.1f}s: "
                "handles of earlier versions are alive somewhere (a consumer, a pending task, "
                "a variable). Drop them once loaded, raise depth, or pass a larger timeout"
            ) from None


def _slot_offsets(
    sizes: list[int], blocks: tuple[tuple[int, int] | None, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Where each tensor starts in a slot, and for blocked ones the bytes between
    their blocks: unblocked tensors first, end to end; then, for each number of
    parts, ``parts`` regions, region k holding block k of each such tensor."""
    offsets, strides = [0] * len(sizes), [0] * len(sizes)
    plain = [i for i in range(len(sizes)) if not blocks or blocks[i] is None]
    starts, end = aligned_offsets([sizes[i] for i in plain])
    for i, start in zip(plain, starts, strict=True):
        offsets[i] = start
    by_parts: dict[int, list[int]] = {}
    for i, block in enumerate(blocks):
        if block is not None:
            by_parts.setdefault(block[1], []).append(i)
    for parts, members in by_parts.items():
        starts, region = aligned_offsets([sizes[i] // parts for i in members])
        for i, start in zip(members, starts, strict=True):
            offsets[i], strides[i] = end + start, region
        end += region * parts
    return tuple(offsets), tuple(strides) if blocks else ()


def _new_slot(layout: WeightsLayout) -> _Slot:
    spans = []  # (first byte, bytes to the end of the last block) of each tensor
    for i, (off, shape, dtype) in enumerate(
        zip(layout.offsets, layout.shapes, layout.dtypes, strict=True)
    ):
        size, block = nbytes_of(shape, dtype), layout.block_of(i)
        if block is not None:
            size = (block[1] - 1) * layout.block_stride(i) + size // block[1]
        spans.append((off, size))
    nbytes = max((off + size for off, size in spans), default=0)
    # Never inference tensors, nor views made in inference mode (a publish inside
    # torch.inference_mode()): the next publish, in or out of it, writes them in place.
    with torch.inference_mode(False):
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=layout.device)
        views = []
        for i, ((off, size), dtype, shape) in enumerate(
            zip(spans, layout.dtypes, layout.shapes, strict=True)
        ):
            flat = buffer[off : off + size].view(torch_dtype(dtype))
            block = layout.block_of(i)
            stride = layout.block_stride(i) // flat.element_size() if block is not None else None
            views.append(blocked_view(flat, shape, block, stride))
    return _Slot(buffer, views)


def blocked_source(tensor: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """``tensor`` with its ``dim`` split into (parts, size / parts): a view."""
    if block is None:
        return tensor
    dim, parts = block
    return tensor.unflatten(dim, (parts, tensor.shape[dim] // parts))


def blocked_view(
    flat: torch.Tensor,
    shape: tuple[int, ...],
    block: tuple[int, int] | None,
    stride: int | None = None,
) -> torch.Tensor:
    """The elements ``flat`` of one tensor laid out as ``block`` says, block k
    ``stride`` elements after block k - 1 (default: back to back), viewed as
    ``blocked_source`` of the tensor is shaped: block-major memory, logical order."""
    if block is None:
        return flat.view(shape)
    dim, parts = block
    one = (*shape[:dim], shape[dim] // parts, *shape[dim + 1 :])
    inner = torch.empty(one, device="meta").stride()  # a block is contiguous
    step = math.prod(one) if stride is None else stride
    stored = flat.as_strided((parts, *one), (step, *inner), flat.storage_offset())
    return stored.movedim(0, dim)
