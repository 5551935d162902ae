"""Tensor bytes: what travels for each tensor, and the buffers it lands in.

A tensor travels as the bytes of its own elements in row-major order (a view
sends its elements, not its base's storage; a non-contiguous tensor is packed
once, in the producer). The consumer receives every tensor of one object into
one *arena* and hands out views of it, so an object costs one allocation.

Fresh pages cost more than the copy on these machines (DESIGN.md section 7):
a copy into a new ``torch.empty`` runs at ~2.5 GB/s, into memory backed by
transparent huge pages at ~10 GB/s. Large arenas therefore come from an
anonymous ``mmap`` advised ``MADV_HUGEPAGE`` and wrapped as a tensor, which
then owns the mapping (closing it under a live tensor would crash the next read).
"""

from __future__ import annotations

import math
import mmap
import os
import pickle
import sys
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from raydirect import _compression as compression

# Arena slots start on cache-line boundaries so every dtype view is aligned.
_ALIGN = 64
_FEW = 8  # tensors laid out in plain Python (aligned_offsets)
# Below this an arena is an ordinary tensor: a huge page would waste more than
# half of itself. From 1 MiB a reused region pays: a fresh 1 MiB buffer's page
# faults cost 2.3 ms of a 2.8 ms cross-memory read here, a reused one 0.4 ms.
_HUGEPAGE_MIN_BYTES = 1 << 20
_HUGEPAGE = 2 << 20
POOL_ENV = "RAYDIRECT_RECV_POOL_BYTES"
DEFAULT_POOL_BYTES = 1 << 30

KIND_TORCH = 0
KIND_NUMPY = 1
KIND_JAX = 2


class TensorMeta(NamedTuple):
    """What a consumer needs to rebuild one tensor from its bytes. A named tuple:
    an object of thousands of tensors carries thousands of these, and tuples
    are what pickle makes and reads fastest."""

    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix
    nbytes: int
    device: str
    kind: int = KIND_TORCH
    requires_grad: bool = False
    is_parameter: bool = False
    np_dtype: str | None = None  # numpy arrays: their own dtype string


DTYPE_NAMES: dict[torch.dtype, str] = {
    d: str(d).removeprefix("torch.") for d in vars(torch).values() if isinstance(d, torch.dtype)
}

_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def torch_dtype(name: str) -> torch.dtype:
    dtype = _DTYPES.get(name) or getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def _jax_array_type() -> type | None:
    # Only when the program imported jax itself: raydirect never imports it.
    jax = sys.modules.get("jax")
    return getattr(jax, "Array", None) if jax is not None else None


def as_tensor(obj: Any) -> torch.Tensor | None:
    """The torch view of a torch tensor, a plain numpy array or a JAX array
    (through DLPack, no copy), or None when ``obj`` cannot travel as raw bytes
    (object arrays, strings, datetimes)."""
    if isinstance(obj, torch.Tensor):
        return obj
    jax_array = _jax_array_type()
    if jax_array is not None and isinstance(obj, jax_array):
        try:
            return torch.from_dlpack(obj)
        except (RuntimeError, TypeError, BufferError):  # devices or dtypes torch lacks
            return None
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            return None
        try:
            # np.ascontiguousarray would turn a 0-d array into shape (1,).
            arr = obj if obj.flags.c_contiguous else np.ascontiguousarray(obj)
            if not arr.flags.writeable:
                arr = arr.copy()
            return torch.from_numpy(arr)
        except TypeError:  # dtypes torch lacks (strings, datetime64, ...)
            return None
    return None


# kind, requires_grad, is_parameter, np_dtype of a plain torch tensor without grad.
_PLAIN_REST = (KIND_TORCH, False, False, None)


class TensorMetas(Sequence[TensorMeta]):
    """The ``TensorMeta`` of each tensor of one object, kept as columns.

    An object of thousands of tensors is then described, packed, sent and
    unpacked in bulk (lists that pickle reads and writes in C), and the hot paths
    read the column they need (``nbytes``, ``shapes``) with no Python object per
    tensor. Indexing gives a ``TensorMeta``, as a list of them would."""

    __slots__ = ("shapes", "dtypes", "nbytes", "devices", "rest")

    def __init__(
        self,
        shapes: list[tuple[int, ...]],
        dtypes: list[str],
        nbytes: list[int],
        devices: list[str],
        rest: list[tuple[int, bool, bool, str | None]] | None = None,
    ) -> None:
        self.shapes = shapes
        self.dtypes = dtypes
        self.nbytes = nbytes
        self.devices = devices
        # (kind, requires_grad, is_parameter, np_dtype) per tensor; None: all plain.
        self.rest = rest

    @classmethod
    def of(cls, metas: Iterable[TensorMeta]) -> TensorMetas:
        rows = list(metas)
        rest = [(m.kind, m.requires_grad, m.is_parameter, m.np_dtype) for m in rows]
        return cls(
            [m.shape for m in rows],
            [m.dtype for m in rows],
            [m.nbytes for m in rows],
            [m.device for m in rows],
            None if all(r == _PLAIN_REST for r in rest) else rest,
        )

    def __len__(self) -> int:
        return len(self.nbytes)

    def __getitem__(self, i: int) -> TensorMeta:  # type: ignore[override]
        rest = _PLAIN_REST if self.rest is None else self.rest[i]
        return TensorMeta(self.shapes[i], self.dtypes[i], self.nbytes[i], self.devices[i], *rest)

    def __iter__(self) -> Iterator[TensorMeta]:
        return (self[i] for i in range(len(self)))

    def select(self, indices: Iterable[int]) -> TensorMetas:
        """The metas of tensors ``indices``, in that order."""
        pick = list(indices)
        return TensorMetas(
            [self.shapes[i] for i in pick],
            [self.dtypes[i] for i in pick],
            [self.nbytes[i] for i in pick],
            [self.devices[i] for i in pick],
            None if self.rest is None else [self.rest[i] for i in pick],
        )

    def total_bytes(self) -> int:
        return sum(self.nbytes)

    def pack(self) -> bytes:
        """The columns as bytes: each distinct shape once and, per tensor, the
        index of its shape (a model repeats a few shapes: ints pickle in bulk,
        tuples one by one, and unpacking is one list lookup a tensor),
        compressed (5,000 tensors' metas are 93 KB raw, under 1 KB packed), so
        that the Payload stays under Ray's inline limit."""
        distinct: dict[tuple[int, ...], int] = {}
        index = [distinct.setdefault(shape, len(distinct)) for shape in self.shapes]
        shapes = list(map(tuple, distinct))  # plain tuples, not torch.Size
        columns = (shapes, index, self.dtypes, self.nbytes, self.devices, self.rest)
        return compression.pack(pickle.dumps(columns, protocol=5))

    @classmethod
    def unpack(cls, blob: bytes) -> TensorMetas:
        shapes, index, dtypes, nbytes, devices, rest = pickle.loads(compression.unpack(blob))
        return cls(list(map(shapes.__getitem__, index)), dtypes, nbytes, devices, rest)


def describe_all(
    originals: list[Any], tensors: list[torch.Tensor], plain: bool = False
) -> TensorMetas:
    """``describe`` each (original, torch view) pair; plain torch tensors in bulk
    (``plain``: the caller knows every original is one)."""
    if not plain and not all([type(o) is torch.Tensor for o in originals]):
        return TensorMetas.of(describe(o, t) for o, t in zip(originals, tensors, strict=True))
    # One pass per attribute: an object of thousands of tensors pays C calls, not
    # a Python function call per tensor. Shapes stay torch.Size (a tuple): ``pack``
    # sends each distinct one once, as a plain tuple.
    grads = [t.requires_grad for t in tensors]
    return TensorMetas(
        [t.shape for t in tensors],
        [DTYPE_NAMES[t.dtype] for t in tensors],
        [t.nbytes for t in tensors],
        device_types(tensors),
        [(KIND_TORCH, g, False, None) for g in grads] if any(grads) else None,
    )


def device_types(tensors: list[torch.Tensor]) -> list[str]:
    return ["cpu" if t.is_cpu else t.device.type for t in tensors]  # .device costs more


def describe(obj: Any, tensor: torch.Tensor) -> TensorMeta:
    is_numpy = isinstance(obj, np.ndarray)
    kind = KIND_NUMPY if is_numpy else KIND_TORCH if isinstance(obj, torch.Tensor) else KIND_JAX
    return TensorMeta(
        shape=tuple(tensor.shape),
        dtype=DTYPE_NAMES[tensor.dtype],
        nbytes=tensor.numel() * tensor.element_size(),
        device=tensor.device.type,
        kind=kind,
        requires_grad=bool(getattr(obj, "requires_grad", False)),
        is_parameter=isinstance(obj, torch.nn.Parameter),
        np_dtype=obj.dtype.str if is_numpy else None,
    )


def storage_keys(tensors: Sequence[torch.Tensor]) -> list[int]:
    """What identifies the memory each tensor lies in: its storage's address (0
    for storage without bytes, which nothing can read). A view, or a
    ``state_dict()`` entry of a parameter, has the key of the memory it shares."""
    return [t.untyped_storage().data_ptr() for t in tensors]


def storage_key(obj: Any) -> int:
    """``storage_keys`` of one tensor, numpy array or JAX array (0: none)."""
    tensor = as_tensor(obj)
    return 0 if tensor is None else tensor.untyped_storage().data_ptr()


UNTRACKED = -1
"""The version ``version_counters`` gives an inference tensor: it has no counter."""


def version_counters(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Each tensor's version counter, read when it is exported, so a later in-place
    write can be told. Tensors made under ``torch.inference_mode()`` keep no
    counter (torch raises on ``_version``): they get ``UNTRACKED``, and in-place
    writes to them cannot be detected."""
    try:
        return [t._version for t in tensors]
    except RuntimeError:  # only now pay for asking each tensor
        return [UNTRACKED if t.is_inference() else t._version for t in tensors]


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-d uint8 tensor over exactly this tensor's elements (packing a
    non-contiguous tensor once)."""
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1)
    if flat.numel() <= 1 and flat.stride() != (1,):
        # torch calls a tensor of at most one element contiguous whatever its
        # stride (x[::2] of two elements), but refuses to view it as bytes.
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


def arena_layout(metas: Sequence[TensorMeta]) -> tuple[list[int], int]:
    """Offsets of each tensor in an arena, and the arena's size."""
    if isinstance(metas, TensorMetas):
        return aligned_offsets(metas.nbytes)
    return aligned_offsets([meta.nbytes for meta in metas])


def aligned_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of regions of ``sizes`` bytes laid end to end, each aligned to a
    cache line (so every dtype view is aligned), and the total size."""
    if not sizes:
        return [], 0
    if len(sizes) <= _FEW:  # numpy's fixed cost (10 us) is most of a medium transfer's layout
        offsets, end = [], 0
        for size in sizes:
            offsets.append(end)
            end += (size + _ALIGN - 1) // _ALIGN * _ALIGN
        return offsets, end
    rounded = (np.asarray(sizes, dtype=np.int64) + (_ALIGN - 1)) // _ALIGN * _ALIGN
    ends = np.cumsum(rounded)
    return (ends - rounded).tolist(), int(ends[-1])


class _ReceiveRegions:
    """Huge-page receive regions, reused once no tensor views them any more.

    On these machines a fresh page costs more than the copy (and the VM hands
    freed memory back to the host, so even recycled pages fault again); a
    region kept mapped and reused receives at memory speed. A region is free
    again when its only references are this pool's: the tensors handed out
    keep it alive through their storage.
    """

    def __init__(self) -> None:
        self._regions: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._free_refcount = self._refcount_when_unused()

    @staticmethod
    def idle_cap() -> int:
        """Bytes of unused regions kept for reuse (``RAYDIRECT_RECV_POOL_BYTES``,
        default 1 GiB; 0: no pool, every receive gets new memory). Read at each
        allocation, so a process can change it while it runs."""
        return int(os.environ.get(POOL_ENV, DEFAULT_POOL_BYTES))

    def _refcount_when_unused(self) -> int:
        # No other reference to the probe may exist while it is counted.
        self._regions.append(mmap.mmap(-1, mmap.PAGESIZE))
        try:
            return self._refcounts()[0]
        finally:
            self._regions.clear()

    def _refcounts(self) -> list[int]:
        return [sys.getrefcount(region) for region in self._regions]

    def take(self, size: int) -> torch.Tensor:
        """A uint8 tensor over a region of at least ``size`` bytes (rounded to huge pages)."""
        rounded = (size + _HUGEPAGE - 1) // _HUGEPAGE * _HUGEPAGE
        cap = self.idle_cap()
        with self._lock:
            counts = self._refcounts()
            free = [i for i, n in enumerate(counts) if n <= self._free_refcount]
            fits = [i for i in free if rounded <= len(self._regions[i]) <= rounded + rounded // 8]
            if cap <= 0:
                fits = []
            if fits:
                region = self._regions[min(fits, key=lambda i: len(self._regions[i]))]
            else:
                region = mmap.mmap(-1, rounded, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                if hasattr(mmap, "MADV_HUGEPAGE"):
                    region.madvise(mmap.MADV_HUGEPAGE)
                if cap > 0:  # 0: no reuse, nothing kept
                    self._regions.append(region)
                self._trim(free, cap)
            # The tensor keeps ``region`` alive; it is reused (or unmapped) after the last view.
            return torch.frombuffer(region, dtype=torch.uint8, count=size)

    def _trim(self, free: list[int], cap: int) -> None:
        idle = sum(len(self._regions[i]) for i in free)
        drop = set()
        for i in free:  # oldest first
            if idle <= cap:
                break
            idle -= len(self._regions[i])
            drop.add(i)
        self._regions = [r for i, r in enumerate(self._regions) if i not in drop]

    def idle_bytes(self) -> int:
        with self._lock:
            counts = self._refcounts()
            return sum(
                len(r)
                for r, n in zip(self._regions, counts, strict=True)
                if n <= self._free_refcount
            )


_regions = _ReceiveRegions()


def allocate_bytes(nbytes: int, device: str = "cpu") -> torch.Tensor:
    """A 1-d uint8 tensor of ``nbytes`` on ``device``; on the CPU, large ones come
    from reusable huge-page regions."""
    if device != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    if nbytes < _HUGEPAGE_MIN_BYTES:
        return torch.empty(nbytes, dtype=torch.uint8)
    return _regions.take(nbytes)


# torch dtypes numpy has, for ``_stack``; the others are read as unsigned
# integers of their width, then reinterpreted.
_NUMPY_DTYPES = {
    t: np.dtype(n)
    for t, n in (
        (torch.float16, "float16"), (torch.float32, "float32"), (torch.float64, "float64"),
        (torch.complex64, "complex64"), (torch.complex128, "complex128"), (torch.bool, "bool"),
        (torch.uint8, "uint8"), (torch.int8, "int8"), (torch.int16, "int16"),
        (torch.int32, "int32"), (torch.int64, "int64"),
    )
}  # fmt: skip
_SAME_WIDTH = {n: np.dtype(f"uint{8 * n}") for n in (1, 2, 4, 8)}


def tensors_from_arena(arena: torch.Tensor, metas: TensorMetas, offsets: list[int]) -> list:
    """Views of ``arena`` shaped as ``metas`` describe: torch tensors or numpy arrays.

    Each tensor is an index into a view of the arena made once per (dtype,
    shape) (``_stack``): torch's view methods (``view``, ``as_strided``) let the
    GIL go, and in a process where another thread runs Python each such call
    waits up to the switch interval (5 ms) to have it back, while indexing keeps
    it. Beside a busy thread, 64 tensors took 25-80 ms with a view each."""
    host = arena.numpy() if arena.device.type == "cpu" else None
    stacks: dict[tuple[str, tuple[int, ...]], tuple[torch.Tensor, int]] = {}
    out: list[Any] = []
    for shape, dtype, nbytes, off in zip(
        metas.shapes, metas.dtypes, metas.nbytes, offsets, strict=True
    ):
        if nbytes == 0:  # no bytes in the arena, but on its device like the others
            out.append(torch.empty(shape, dtype=torch_dtype(dtype), device=arena.device))
            continue
        stack = stacks.get((dtype, shape))
        if stack is None:
            stack = stacks[(dtype, shape)] = _stack(arena, host, torch_dtype(dtype), shape)
        # Slots are 64-byte aligned, so every offset is a whole element.
        out.append(stack[0][off // stack[1]])
    if metas.rest is None:
        return out
    return [
        t if rest == _PLAIN_REST else finish(t, metas[i])
        for i, (t, rest) in enumerate(zip(out, metas.rest, strict=True))
    ]


def _stack(
    arena: torch.Tensor, host: np.ndarray | None, dtype: torch.dtype, shape: tuple[int, ...]
) -> tuple[torch.Tensor, int]:
    """A view of ``arena`` whose item ``i`` is a tensor of ``shape`` and ``dtype``
    starting ``i`` elements in, and the element size. Made with numpy where the
    arena is host memory, and so without letting the GIL go; dtypes numpy lacks
    (bfloat16, float8) are reinterpreted after, with one torch call."""
    size = dtype.itemsize
    numel = math.prod(shape)
    count = arena.numel() // size - numel + 1
    steps = (1, *contiguous_strides(shape))
    if host is None:
        return arena.view(dtype).as_strided((count, *shape), steps), size
    native = _NUMPY_DTYPES.get(dtype)
    stack = np.ndarray(
        (count, *shape),
        dtype=native or _SAME_WIDTH[size],
        buffer=host,
        strides=tuple(s * size for s in steps),
    )
    tensor = torch.from_numpy(stack)
    return (tensor if native else tensor.view(dtype)), size


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape``."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return tuple(strides)


def finish(t: torch.Tensor, meta: TensorMeta) -> Any:
    """Give a received tensor back its Python type: numpy or JAX array,
    Parameter, grad flag."""
    if meta.kind == KIND_JAX:
        import jax.dlpack  # the producer sent a JAX array: the consumer has jax too

        # Zero-copy where JAX accepts the buffer (arena slots are 64-byte aligned);
        # the array keeps the receive buffer alive through the DLPack capsule.
        return jax.dlpack.from_dlpack(t.contiguous())
    if meta.kind == KIND_NUMPY:
        arr = t.numpy()
        if meta.np_dtype is not None and arr.dtype.str != meta.np_dtype:
            arr = arr.view(np.dtype(meta.np_dtype))
        return arr
    if meta.is_parameter:
        return torch.nn.Parameter(t, requires_grad=meta.requires_grad)
    if meta.requires_grad:
        t.requires_grad_(True)
    return t


def _forget_after_fork() -> None:
    _regions._lock = threading.Lock()  # a receive on another thread may have held it


os.register_at_fork(after_in_child=_forget_after_fork)
