"""Workload 10's two processes: a region's owner (a paged KV cache) and its reader.

The owner holds ``LAYERS`` int32 tensors of ``BLOCKS`` blocks of ``BLOCK_BYTES``,
exported once as a region, and, for the object rows, one tensor per read size.
The reader holds, per read size, destination blocks touched once and reused
(as a decode engine's paged blocks are), and the rows of that read: a fixed
random choice of source blocks of every layer into its blocks in order. Every
system's one operation is timed inside the reader (``timed``), on its own
thread, and checked after, untimed, against the seed the owner wrote.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import ray
import torch

import raydirect as rd
from raydirect import _region_rows
from raydirect.transports import nixl_agent  # NIXL itself is imported on first use
from rdbench.common import (
    ACTOR_NUM_CPUS,
    DTYPE,
    ELEMENT_BYTES,
    FREE_TIMEOUT_S,
    TRANSFER_TIMEOUT_S,
    check_pattern,
    fill_pattern,
    huge_page_bytes,
    part_seed,
)

LAYERS = 4
BLOCK_BYTES = 8 << 10
BLOCK_ELEMS = BLOCK_BYTES // ELEMENT_BYTES
BLOCKS = 1024  # per layer: a 32 MiB region
CHOICE_SEED = 40  # the blocks each read takes (fixed: every system reads the same bytes)

# The operations a reader times, by name (workload 10's systems map onto them).
REGION_AUTO, REGION_SHM, REGION_TCP = "region", "region_shm", "region_tcp"
REGION_4K = "region_4k"  # the same read from the copy on 4 KiB pages
_FORCED = {REGION_AUTO: None, REGION_4K: None, REGION_SHM: "shm", REGION_TCP: "tcp"}
OBJECT_RD, OBJECT_STORE = "object_rd", "object_store"
NIXL, FLOOR = "nixl", "floor"


def blocks_for(nbytes: int) -> np.ndarray:
    """Per layer, the source blocks a read of ``nbytes`` takes: (LAYERS, n) ids."""
    per_layer = nbytes // BLOCK_BYTES // LAYERS
    if per_layer < 1 or per_layer > BLOCKS or per_layer * BLOCK_BYTES * LAYERS != nbytes:
        raise ValueError(f"a read of {nbytes} bytes is not whole blocks of every layer")
    rng = np.random.default_rng(CHOICE_SEED)
    return np.stack([rng.choice(BLOCKS, per_layer, replace=False) for _ in range(LAYERS)])


def rows_for(ids: np.ndarray) -> np.ndarray:
    """``read_ranges`` rows: block ``ids[l, k]`` of layer ``l`` into block ``k`` of
    destination ``l``."""
    layers, per_layer = ids.shape
    layer = np.repeat(np.arange(layers), per_layer)
    k = np.tile(np.arange(per_layer), layers)
    size = np.full(layers * per_layer, BLOCK_BYTES)
    return np.stack([layer, ids.reshape(-1) * BLOCK_BYTES, size, layer, k * BLOCK_BYTES], 1)


def _nixl_agent(role: str) -> Any:
    """A NIXL agent (UCX), with raydirect's progress-thread pause (1 ms unless
    ``RAYDIRECT_NIXL_PROGRESS_DELAY_US`` says otherwise: NIXL's own 0 would keep
    a core of this 2-core machine busy for the process's life)."""
    api = nixl_agent.nixl_api()
    config = api.nixl_agent_config(enable_prog_thread=True, backends=["UCX"])
    return nixl_agent.new_agent(api, f"bench-{role}-{os.getpid()}", config)


@ray.remote(num_cpus=ACTOR_NUM_CPUS)
class RegionOwner:
    def __init__(self) -> None:
        self.layers = [torch.empty(BLOCKS * BLOCK_ELEMS, dtype=DTYPE) for _ in range(LAYERS)]
        # The same cache on 4 KiB pages: numpy's memory (glibc's), not PyTorch's
        # huge-page allocator's, exported as it is (huge_pages=False).
        elements = BLOCKS * BLOCK_ELEMS
        self.small = [torch.from_numpy(np.empty(elements, np.int32)) for _ in self.layers]
        for k, (layer, small) in enumerate(zip(self.layers, self.small, strict=True)):
            fill_pattern(layer, part_seed(0, k))  # every page touched before any read
            fill_pattern(small, part_seed(0, k))
        self.region = rd.export_region(self.layers, name="bench-kv")
        self.small_region = rd.export_region(self.small, name="bench-kv-4k", huge_pages=False)
        self.objects: dict[int, torch.Tensor] = {}
        self.nixl: Any = None

    def handles(self) -> tuple[rd.RegionHandle, rd.RegionHandle]:
        """The region's handle, and the one of its copy on 4 KiB pages."""
        return self.region.handle(), self.small_region.handle()

    def huge_pages(self) -> int:
        """Bytes of this process's memory on huge pages."""
        return huge_page_bytes()

    def allocate(self, nbytes: int) -> None:
        self.objects[nbytes] = torch.empty(nbytes // ELEMENT_BYTES, dtype=DTYPE)
        fill_pattern(self.objects[nbytes], 0)

    def prepare(self, seed: int) -> int:
        """Write every layer, and every object's tensor, with ``seed`` (untimed)."""
        for k, (layer, small) in enumerate(zip(self.layers, self.small, strict=True)):
            fill_pattern(layer, part_seed(seed, k))
            fill_pattern(small, part_seed(seed, k))
        for tensor in self.objects.values():
            rd.wait_tensor_freed(tensor, timeout=FREE_TIMEOUT_S)
            fill_pattern(tensor, seed)
        return seed

    @rd.method
    def object_rd(self, nbytes: int) -> torch.Tensor:
        return self.objects[nbytes]

    def object_store(self, nbytes: int) -> torch.Tensor:
        return self.objects[nbytes]

    def nixl_metadata(self) -> tuple[bytes, list[int]]:
        """Register the layers with a NIXL agent of this process: its metadata and
        the layers' addresses."""
        if self.nixl is None:
            self.nixl = _nixl_agent("owner")
            self.nixl.register_memory(self.layers)
        return self.nixl.get_agent_metadata(), [t.data_ptr() for t in self.layers]

    def close(self) -> None:
        self.region.close()
        self.small_region.close()


@ray.remote(num_cpus=ACTOR_NUM_CPUS)
class RegionReader:
    def __init__(self) -> None:
        torch.set_num_threads(1)  # as Ray workers run: the floor copies on one thread
        self.handles: Any = None
        self.reads: dict[int, tuple[np.ndarray, np.ndarray, list[torch.Tensor]]] = {}
        self.nixl: Any = None
        self.nixl_reads: dict[int, Any] = {}
        self.source = [torch.empty(BLOCKS * BLOCK_ELEMS, dtype=DTYPE) for _ in range(LAYERS)]

    def setup(self, handles: Any, owner: Any, nbytes: int) -> int:
        """The destination blocks and rows of a read of ``nbytes``; returns the
        rows left once the ones that touch on both sides are merged."""
        self.handles, self.owner = handles, owner
        ids = blocks_for(nbytes)
        dests = [torch.zeros(ids.shape[1] * BLOCK_ELEMS, dtype=DTYPE) for _ in range(LAYERS)]
        rows = rows_for(ids)
        self.reads[nbytes] = (ids, rows, dests)
        sizes = [BLOCKS * BLOCK_BYTES] * LAYERS
        return len(
            _region_rows.checked_rows(
                rows, sizes, [d.nbytes for d in dests], [d.data_ptr() for d in dests]
            )
        )

    def setup_nixl(self, metadata: bytes, addresses: list[int], nbytes: int) -> None:
        """A NIXL READ of the same runs into the same blocks, prepared once (the
        registration, the remote agent, the descriptors); each read reposts it."""
        if self.nixl is None:
            self.nixl = _nixl_agent("reader")
            self.remote = self.nixl.add_remote_agent(metadata)
        ids, _, dests = self.reads[nbytes]
        self.nixl.register_memory(dests)
        local, remote = [], []
        for layer in range(LAYERS):
            for k, block in enumerate(ids[layer].tolist()):
                local.append((dests[layer].data_ptr() + k * BLOCK_BYTES, BLOCK_BYTES, 0))
                remote.append((addresses[layer] + block * BLOCK_BYTES, BLOCK_BYTES, 0))
        self.nixl_reads[nbytes] = self.nixl.initialize_xfer(
            "READ",
            self.nixl.get_xfer_descs(local, "DRAM"),
            self.nixl.get_xfer_descs(remote, "DRAM"),
            self.remote,
        )

    def timed(self, operation: str, nbytes: int, seed: int) -> float:
        """One ``operation`` of a read of ``nbytes``, timed; then checked, untimed."""
        ids, rows, dests = self.reads[nbytes]
        for d in dests:
            d.zero_()  # untimed: a read that lands nothing fails the check
        if operation == FLOOR:
            for k, layer in enumerate(self.source):
                fill_pattern(layer, part_seed(seed, k))
        start = time.perf_counter()
        got = self._run(operation, nbytes, ids, rows, dests)
        seconds = time.perf_counter() - start
        if got is not None:  # an object: its bytes are the pattern of the seed
            check_pattern(got, seed, nbytes)
        else:
            _check_blocks(ids, dests, seed)
        return seconds

    def _run(
        self, operation: str, nbytes: int, ids: np.ndarray, rows: np.ndarray, dests: list
    ) -> torch.Tensor | None:
        if operation in _FORCED:
            handle, forced = self.handles[operation == REGION_4K], _FORCED[operation]
            rd.read_ranges(
                handle, rows, into=dests, timeout=TRANSFER_TIMEOUT_S, tensor_transport=forced
            )
            return None
        if operation == OBJECT_RD:
            return rd.get(self.owner.object_rd.remote(nbytes), timeout=TRANSFER_TIMEOUT_S)
        if operation == OBJECT_STORE:
            return ray.get(self.owner.object_store.remote(nbytes), timeout=TRANSFER_TIMEOUT_S)
        if operation == NIXL:
            _nixl_read(self.nixl, self.nixl_reads[nbytes])
            return None
        if operation == FLOOR:
            for layer in range(LAYERS):
                source = self.source[layer].view(BLOCKS, BLOCK_ELEMS)
                index = torch.from_numpy(ids[layer])
                torch.index_select(source, 0, index, out=dests[layer].view(-1, BLOCK_ELEMS))
            return None
        raise ValueError(f"unknown operation {operation!r}")


def _nixl_read(agent: Any, handle: Any) -> None:
    deadline = time.monotonic() + TRANSFER_TIMEOUT_S
    state = agent.transfer(handle)
    while state == "PROC":
        if time.monotonic() > deadline:
            raise TimeoutError("the NIXL READ did not finish")
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"the NIXL READ ended in state {state}")


def _check_blocks(ids: np.ndarray, dests: list[torch.Tensor], seed: int) -> None:
    """Every destination block holds its source block of the seed's pattern."""
    within = torch.arange(BLOCK_ELEMS, dtype=DTYPE)
    for layer, dest in enumerate(dests):
        starts = torch.from_numpy(ids[layer] * BLOCK_ELEMS).to(DTYPE)[:, None]
        want = starts + within + part_seed(seed, layer)
        got = dest.view(-1, BLOCK_ELEMS)
        if not torch.equal(got, want):
            bad = int((got != want).any(1).nonzero()[0])
            raise ValueError(f"layer {layer}, block {bad} (source {ids[layer][bad]}) differs")
