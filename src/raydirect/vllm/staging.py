"""Where a worker receives a version before the model is touched.

A ``Receiver`` holds one staging tensor per published tensor the worker reads,
kept across updates (no fresh allocation, no page faults after the first), and
a ``rd.WeightSubscriber`` over them: with tensor parallelism each staging tensor
receives only this worker's slice (``shard=``). vLLM's loaders expect whole
checkpoint tensors and slice them themselves, so each is handed a whole-shaped
view laid over the staging memory with the slice's strides: the loader's own
slice of that view is exactly the bytes received, and the rest of it is never
read (nor, being untouched, ever backed by memory).

Layers the survey found to be pure slices and concatenations of published
tensors skip the loaders: the receiver keeps one tensor per tensor of such a
layer, in the layout the loaders would have filled, and receives each published
box straight into its place there (``landed``); the worker then has vLLM
process those tensors as its reload would have processed the loaders' output.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

import raydirect as rd
from raydirect.vllm.landing import Box, Landing, Survey, contiguous_strides, cut_dims


def _slice_of(full: tuple[int, ...], box: Box) -> tuple[int, int, int] | None:
    """``box`` as ``(dim, start, stop)``, None for the whole tensor; a box cut
    along more than one dim is taken whole (no vLLM loader cuts so)."""
    cut = cut_dims(box, full)
    if len(cut) != 1:
        return None
    d = cut[0]
    return d, box[0][d], box[0][d] + box[1][d]


def _sliced(
    shape: tuple[int, ...], cut: tuple[int, int, int]
) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """A slice's staging: its shape, its contiguous strides, and the elements
    that a whole-shaped view over it with those strides spans."""
    dim, start, stop = cut
    local = (*shape[:dim], stop - start, *shape[dim + 1 :])
    strides = contiguous_strides(local)
    return local, strides, sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1


def staging_bytes(published: list[tuple[str, torch.dtype, tuple[int, ...]]], plan: Survey) -> int:
    """The bytes a ``Receiver`` of this layout allocates, before it does."""
    size = {name: dtype.itemsize for name, dtype, _shape in published}
    total = sum(
        math.prod(shape) * dtype.itemsize
        for tensors in plan.layers.values()
        for shape, dtype in tensors.values()
    )
    for name, _dtype, shape in published:
        if name not in plan.reads or name in plan.lands:
            continue
        cut = _slice_of(shape, plan.reads[name])
        total += size[name] * (math.prod(shape) if cut is None else _sliced(shape, cut)[2])
    return total


def free_bytes(device: torch.device) -> int:
    """What an allocation on ``device`` may take now: the GPU's free memory and
    what PyTorch's caching allocator holds unused there; for host memory, the
    kernel's MemAvailable."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_room(need: int, device: torch.device) -> None:
    """Refuses, before a byte is allocated or moves, staging that does not fit."""
    free = free_bytes(device)
    if need <= free:
        return
    fix = (
        "start the engine with a lower gpu_memory_utilization (vLLM's default, 0.92, "
        "leaves little room beside the KV cache), or stage in host memory: "
        "RaydirectTrainerInitInfo(host_staging=True); keep_staging=False then gives "
        "the memory back after each update"
        if device.type == "cuda"
        else "free host memory on the engine's machine, or update a smaller model"
    )
    raise rd.WeightSyncError(
        f"staging this worker's share of the update takes {need / 2**30:.2f} GiB of "
        f"{device.type} memory and {free / 2**30:.2f} GiB is free: {fix}. All or nothing "
        "receives every byte before it loads (docs/vllm.md, What an update costs in memory)"
    )


class Receiver:
    """Staging for one published layout (names, dtypes, global shapes) in one
    worker, on ``device``: the engine's GPU where the trainer's tensors are on a
    GPU too (read device to device), else host memory, pinned where the engine
    is on a GPU (its loaders then copy it to the device). Landed layers are host
    layers only (the survey lands no other)."""

    def __init__(
        self,
        published: list[tuple[str, torch.dtype, tuple[int, ...]]],
        plan: Survey,
        device: torch.device | None = None,
        pinned: bool = False,
    ) -> None:
        device = device or torch.device("cpu")
        pinned = pinned and device.type == "cpu"

        def empty(shape: Any, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device=device, pin_memory=pinned)

        self.whole: dict[str, torch.Tensor] = {}  # what the loaders get
        self._staged: dict[str, torch.Tensor] = {}  # what the subscriber fills
        self._slices: dict[str, tuple[int, int, int]] = {}
        self._shapes = {name: shape for name, _dtype, shape in published}
        # layer -> tensor name -> what vLLM processes in place of the loaders' output
        self.landed = {
            layer: {n: torch.empty(shape, dtype=dtype) for n, (shape, dtype) in tensors.items()}
            for layer, tensors in plan.layers.items()
        }
        self._landed_names = set(plan.lands)
        for name, dtype, shape in published:
            if name not in plan.reads:
                continue  # no loader of this worker reads it
            cut = _slice_of(shape, plan.reads[name])
            if cut is not None:
                self._slices[name] = cut
            if name in plan.lands:
                self._staged[name] = self._landing(plan.lands[name])
                continue
            if cut is None:
                self._staged[name] = self.whole[name] = empty(shape, dtype)
                continue
            dim, start, _stop = cut
            local, strides, span = _sliced(shape, cut)
            memory = empty(span, dtype)
            self.whole[name] = memory.as_strided(shape, strides, 0)
            self._staged[name] = memory.as_strided(local, strides, start * strides[dim])
        self.bytes = sum(t.numel() * t.element_size() for t in self._staged.values())
        self.retie = plan.retie
        self.landed_bytes = sum(
            t.numel() * t.element_size() for ts in self.landed.values() for t in ts.values()
        )
        self._sub = rd.WeightSubscriber(self._staged, shard=self._shard, strict=False)
        self._relay: rd.WeightPublisher | None = None
        self.key = repr(sorted((n, self._slices.get(n)) for n in self._staged))

    def _landing(self, land: Landing) -> torch.Tensor:
        view = self.landed[land.layer][land.param]
        for d, (start, n) in enumerate(zip(*land.dst, strict=True)):
            view = view.narrow(d, start, n)
        return view

    def _shard(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        return self._slices.get(name)

    @property
    def staged(self) -> list[str]:
        """The published names this worker receives."""
        return list(self._staged)

    def memory(self) -> list[torch.Tensor]:
        """Every tensor whose storage this receiver writes into."""
        landed = [t for tensors in self.landed.values() for t in tensors.values()]
        return landed + [t for n, t in self._staged.items() if n not in self._landed_names]

    def receive(self, handles: list[Any], timeout: float) -> None:
        """Every staged tensor's bytes of the version ``handles`` (one per trainer
        rank) hold; raises ``rd.WeightSyncError`` if any fails to arrive. Waits
        first until no other engine's worker reads the last version relayed from
        this staging (within ``timeout``)."""
        deadline = time.monotonic() + timeout
        if self._relay is not None:
            try:
                for tensor in self._staged.values():
                    rd.wait_tensor_freed(tensor, timeout=max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                raise rd.WeightSyncError(
                    "another engine's worker still reads the last version relayed from this "
                    "worker's staging"
                ) from None
        self._sub.version = None  # the engine, not the subscriber, orders versions
        self._sub.load(handles, timeout=max(deadline - time.monotonic(), 0.0))

    def relay(self, version: int) -> rd.WeightsHandle:
        """Publishes what was received, in place, for workers of other engines on
        this node that read the same: the trainer sends it once per node, not once
        per engine. Valid until the next ``receive``."""
        if self._relay is None or (self._relay.version or 0) >= version:  # a new trainer
            self._relay = rd.WeightPublisher(self._staged, depth=0, placement=self._placement)
        return self._relay.publish(version)

    def _placement(self, name: str, local: tuple[int, ...]) -> Any:
        cut = self._slices.get(name)
        return None if cut is None else (self._shapes[name], cut[0], cut[1])

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, whole-shaped tensor) for ``model.load_weights``."""
        yield from self.whole.items()
