"""Where each (layer, block) of a paged KV cache lies, as byte runs of a region.

vLLM hands a KV connector one tensor per attention layer. How a block lies in it
depends on the attention backend:

=========================  ======================================  =================
backend                    a layer's cache                         one block is
=========================  ======================================  =================
CPU                        ``[num_blocks, kv_heads, block, 2*hd]``  one run
FlashAttention (NHD)       ``[2, num_blocks, block, kv_heads, hd]`` two runs: K, V
FlashAttention (HND)       the same, strides permuted to           two runs: K, V
                           ``[2, num_blocks, kv_heads, block, hd]``
FlashInfer                 ``[num_blocks, 2, block, kv_heads, hd]`` one run
=========================  ======================================  =================

So a layer is described by where its block 0 starts in its storage, the stride
from one block to the next, and the runs of one block (offsets within it, one
length). A region exports each distinct storage once, as flat bytes (layers that
share a storage, and views with any strides, need nothing more); rows then count
bytes from the storage's start. Both engines describe their own caches: a
prefill engine's layout travels in the hand-off's parameters, because the runs'
offsets depend on its number of blocks (FlashAttention's V half starts
``num_blocks`` blocks after K), while a block's runs must be the same on both
sides (same model, same backend, same block size) or nothing is read.

Pure: tensors and numpy in, numbers out; nothing here imports vLLM.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from raydirect.vllm import kv_params

# What a prefill engine's layout may hold (it comes in the request): more
# layers, runs per block or tensors than any model's caches have are refused.
MAX_LAYERS = 4096
MAX_RUNS = 1024
MAX_TENSORS = 1 << 16


@dataclass(frozen=True)
class LayerRuns:
    """Block ``b`` of one layer: ``len(offsets)`` runs of ``length`` bytes at
    ``base + b * block_stride + offset`` in the region's tensor ``tensor``."""

    tensor: int
    base: int
    block_stride: int
    offsets: tuple[int, ...]
    length: int

    def to_list(self) -> list[object]:
        return [self.tensor, self.base, self.block_stride, list(self.offsets), self.length]

    @classmethod
    def from_list(cls, value: object, name: str = "layout entry") -> LayerRuns:
        """``to_list()``'s output, checked as a client's value (``KVParamsError``
        naming the field): a prefill engine's layout arrives in the request."""
        tensor, base, stride, offsets, length = kv_params.items(value, name, 5, 5)
        return cls(
            tensor=kv_params.whole(tensor, f"{name}[0]", high=MAX_TENSORS - 1),
            base=kv_params.whole(base, f"{name}[1]"),
            block_stride=kv_params.whole(stride, f"{name}[2]", low=1),
            offsets=tuple(
                kv_params.whole(o, f"{name}[3][{i}]")
                for i, o in enumerate(kv_params.items(offsets, f"{name}[3]", 1, MAX_RUNS))
            ),
            length=kv_params.whole(length, f"{name}[4]", low=1),
        )

    def end(self, last_block: int) -> int:
        """The byte after the last run of block ``last_block`` (exact: Python ints,
        to check that the rows' int64 arithmetic cannot wrap around)."""
        return self.base + last_block * self.block_stride + max(self.offsets) + self.length

    def same_block_shape(self, other: LayerRuns) -> bool:
        """Whether a block of ``other`` can be copied run by run into one of these."""
        return self.length == other.length and len(self.offsets) == len(other.offsets)


@dataclass(frozen=True)
class CacheLayout:
    """A worker's paged caches: the flat byte tensors to export (one per distinct
    storage) and each layer's runs in them, by layer name."""

    storages: list[torch.Tensor]
    layers: dict[str, LayerRuns]

    def to_dict(self) -> dict[str, list[object]]:
        return {name: runs.to_list() for name, runs in self.layers.items()}


def layout_of(kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> CacheLayout:
    """The layout of vLLM's ``kv_caches`` (``register_kv_caches``'s argument),
    whose block dimension has ``num_blocks`` entries. ``ValueError`` for a cache
    whose blocks cannot be found or whose innermost dimension is not dense."""
    storages: list[torch.Tensor] = []
    index: dict[int, int] = {}
    layers: dict[str, LayerRuns] = {}
    for name, cache in kv_caches.items():
        storage = cache.untyped_storage()
        key = storage.data_ptr()
        if key not in index:
            index[key] = len(storages)
            flat = torch.empty(0, dtype=torch.uint8, device=cache.device)
            storages.append(flat.set_(storage, 0, (storage.nbytes(),), (1,)))
        layers[name] = _runs_of(cache, num_blocks, index[key], name)
    return CacheLayout(storages, layers)


def _runs_of(cache: torch.Tensor, num_blocks: int, tensor: int, name: str) -> LayerRuns:
    item = cache.element_size()
    dims = [d for d in range(min(2, cache.dim())) if cache.shape[d] == num_blocks]
    if not dims:
        raise ValueError(
            f"KV cache of layer {name!r} has shape {tuple(cache.shape)}: no block dimension "
            f"of {num_blocks} blocks among its first two"
        )
    block_dim = dims[0]
    rest = [
        (cache.shape[d], cache.stride(d))
        for d in range(cache.dim())
        if d != block_dim and cache.shape[d] > 1
    ]
    rest.sort(key=lambda sd: sd[1])
    run = 1  # elements in one run: the dense innermost dimensions merged
    while rest and rest[0][1] == run:
        run *= rest.pop(0)[0]
    outer = [range(0, size * stride, stride) for size, stride in reversed(rest)]
    offsets = tuple(sorted(sum(p) * item for p in itertools.product(*outer)))
    return LayerRuns(
        tensor=tensor,
        base=int(cache.storage_offset()) * item,
        block_stride=cache.stride(block_dim) * item,
        offsets=offsets,
        length=run * item,
    )


def block_rows(
    source: Mapping[str, LayerRuns],
    dest: Mapping[str, LayerRuns],
    source_blocks: Iterable[int],
    dest_blocks: Iterable[int],
) -> np.ndarray:
    """``rd.read_ranges`` rows copying block ``source_blocks[i]`` of every layer of
    ``source`` into block ``dest_blocks[i]`` of the same layer of ``dest``: one
    row per (layer, block, run), ``(tensor, offset, length, dest, dest_offset)``.
    ``ValueError`` if the two describe other layers or other block shapes."""
    src = np.asarray(list(source_blocks), dtype=np.int64)
    dst = np.asarray(list(dest_blocks), dtype=np.int64)
    if src.shape != dst.shape:
        raise ValueError(f"{len(src)} source blocks for {len(dst)} destination blocks")
    problem = mismatch(source, dest)
    if problem is not None:
        raise ValueError(problem)
    pairs = []  # per (layer, run): source tensor, offset, stride; length; dest tensor, ...
    for name in sorted(dest):
        theirs, ours = source[name], dest[name]
        for src_off, dst_off in zip(theirs.offsets, ours.offsets, strict=True):
            pairs.append(
                (
                    theirs.tensor,
                    theirs.base + src_off,
                    theirs.block_stride,
                    ours.length,
                    ours.tensor,
                    ours.base + dst_off,
                    ours.block_stride,
                )
            )
    if not pairs:
        return np.empty((0, 5), dtype=np.int64)
    # One table for every (layer, run) at once: a numpy op per column, not per layer.
    runs = np.array(pairs, dtype=np.int64)[:, :, None]
    table = np.empty((len(pairs), len(src), 5), dtype=np.int64)
    table[:, :, 0] = runs[:, 0]
    table[:, :, 1] = runs[:, 1] + src * runs[:, 2]
    table[:, :, 2] = runs[:, 3]
    table[:, :, 3] = runs[:, 4]
    table[:, :, 4] = runs[:, 5] + dst * runs[:, 6]
    return table.reshape(-1, 5)


def mismatch(source: Mapping[str, LayerRuns], dest: Mapping[str, LayerRuns]) -> str | None:
    """Why blocks of ``source`` cannot be copied run by run into ``dest``'s, or None."""
    if set(source) != set(dest):
        missing = sorted(set(source) ^ set(dest))[:4]
        return f"the two KV caches have other layers (e.g. {missing})"
    for name in sorted(dest):
        theirs, ours = source[name], dest[name]
        if not theirs.same_block_shape(ours):
            return (
                f"layer {name!r}: a block is {len(theirs.offsets)} runs of {theirs.length} "
                f"bytes there, {len(ours.offsets)} of {ours.length} here (another block "
                "size, dtype, head count or attention backend)"
            )
    return None


def layers_from_dict(value: object, name: str = "layout") -> dict[str, LayerRuns]:
    """``CacheLayout.to_dict()``'s output, parsed back and checked as a client's
    value (``KVParamsError``, a ``ValueError``, naming the field)."""
    layers = kv_params.table(value, name, MAX_LAYERS)
    return {
        kv_params.text(layer, f"{name} key"): LayerRuns.from_list(runs, f"{name}[{layer!r}]")
        for layer, runs in layers.items()
    }
