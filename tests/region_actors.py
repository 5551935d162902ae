"""Actors for tests/test_regions.py: a region's owner, laid out as a paged KV cache,
and a reader (shipped to workers by value, see test_regions)."""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import ray
import torch

import raydirect as rd
from raydirect.testing import wait_read_counts

LAYERS = 3
BLOCKS = 64
BLOCK_ELEMS = 256  # float32: 1 KiB per (layer, block)
BLOCK_BYTES = BLOCK_ELEMS * 4
POISON = -1.0


def layer_value(layer: int, fill: float | None = None) -> torch.Tensor:
    """Layer ``layer``'s tensor: element ``i`` holds ``i + 100_000 * layer`` (or ``fill``)."""
    if fill is not None:
        return torch.full((BLOCKS, BLOCK_ELEMS), fill, dtype=torch.float32)
    flat = torch.arange(BLOCKS * BLOCK_ELEMS, dtype=torch.float32) + 100_000 * layer
    return flat.reshape(BLOCKS, BLOCK_ELEMS)


def kv_rows(blocks: list[int], dest_blocks: list[int]) -> np.ndarray:
    """Rows reading ``blocks`` of every layer into ``dest_blocks`` of each layer's
    destination (destination ``layer``)."""
    rows = [
        (layer, b * BLOCK_BYTES, BLOCK_BYTES, layer, d * BLOCK_BYTES)
        for layer in range(LAYERS)
        for b, d in zip(blocks, dest_blocks, strict=True)
    ]
    return np.array(rows, dtype=np.int64)


def expected(blocks: list[int], dest_blocks: list[int], fill: float | None = None) -> list:
    """What each destination holds after reading ``kv_rows(blocks, dest_blocks)`` into zeros."""
    out = []
    for layer in range(LAYERS):
        dest = torch.zeros(BLOCKS, BLOCK_ELEMS)
        dest[dest_blocks] = layer_value(layer, fill)[blocks]
        out.append(dest)
    return out


@ray.remote(num_cpus=0, max_concurrency=4)
class Owner:
    """Holds a paged KV cache (one tensor per layer) exported as a region."""

    def __init__(self, transport: str = "auto", on_notice: bool = False) -> None:
        self.kv = {f"layer{i}": layer_value(i) for i in range(LAYERS)}
        self.heard: list[Any] = []
        self.heard_event = threading.Event()
        callback = self._heard if on_notice else None
        self.region = rd.export_region(
            self.kv, name="kv", tensor_transport=transport, on_notice=callback
        )

    def _heard(self, message: Any) -> None:
        self.heard.append(message)
        self.heard_event.set()

    def pid(self) -> int:
        return os.getpid()

    def handle(self) -> rd.RegionHandle:
        return self.region.handle()

    def fill(self, value: float) -> None:
        for t in self.kv.values():
            t.fill_(value)

    def close(self) -> None:
        self.region.close()

    def prepared_reads(self, abandoned_after: float | None = None) -> int:
        """Plug-in reads prepared from this region and not yet released."""
        from raydirect import _region_serve

        if abandoned_after is not None:  # this owner's alone: the default is 30 s
            _region_serve.ABANDONED_AFTER_S = abandoned_after
        return sum(len(s.reads) for s in _region_serve._open.values())

    def close_and_poison(self) -> None:
        """Close, then reuse the memory at once, as the owner may."""
        self.region.close()
        self.fill(POISON)

    def notices(self, timeout: float | None) -> list[Any]:
        return self.region.notices(timeout)

    def wait_heard(self, timeout: float) -> list[Any]:
        self.heard_event.wait(timeout)
        return list(self.heard)

    def stats(self) -> rd.LocalStats:
        return rd.local_stats()


@ray.remote(num_cpus=0, max_concurrency=2)
class RegionReader:
    def __init__(self) -> None:
        self.reads = 0

    def reads_done(self) -> int:
        return self.reads

    def pid(self) -> int:
        return os.getpid()

    def read(
        self,
        handle: Any,
        blocks: list[int],
        dest_blocks: list[int],
        transport: str | None = None,
        notify: Any = None,
        timeout: float | None = 30.0,
    ) -> list[torch.Tensor]:
        dests = [torch.zeros(BLOCKS, BLOCK_ELEMS) for _ in range(LAYERS)]
        rows = kv_rows(blocks, dest_blocks)
        rd.read_ranges(
            handle, rows, into=dests, timeout=timeout, tensor_transport=transport, notify=notify
        )
        return dests

    def read_error(
        self,
        handle: Any,
        transport: str | None,
        timeout: float | None = 30.0,
        blocks: tuple[int, int] = (0, 1),
    ) -> str:
        """The error class and message a read of ``blocks`` (into blocks 0 and 1)
        raises, and whether the destination stayed untouched."""
        dests = [torch.zeros(BLOCKS, BLOCK_ELEMS) for _ in range(LAYERS)]
        try:
            rows = kv_rows(list(blocks), [0, 1])
            rd.read_ranges(handle, rows, into=dests, timeout=timeout, tensor_transport=transport)
        except Exception as exc:
            untouched = all(bool((d == 0).all()) for d in dests)
            return f"{type(exc).__name__}|{untouched}|{exc}"
        return "no error"

    def read_until_lost(self, handle: Any, transport: str | None, limit: int = 100_000) -> dict:
        """Read every block of every layer again and again until the region is
        gone; count reads that returned the poison the owner writes after close."""
        dests = [torch.zeros(BLOCKS, BLOCK_ELEMS) for _ in range(LAYERS)]
        rows = kv_rows(list(range(BLOCKS)), list(range(BLOCKS)))
        ok = poisoned = 0
        for _ in range(limit):
            try:
                rd.read_ranges(handle, rows, into=dests, timeout=30, tensor_transport=transport)
            except rd.ProducerLostError:
                return {"ok": ok, "poisoned": poisoned, "lost": True}
            ok += 1
            self.reads += 1
            poisoned += sum(int((d == POISON).any()) for d in dests)
        return {"ok": ok, "poisoned": poisoned, "lost": False}

    def notify(self, handle: Any, message: Any) -> None:
        rd.notify_region(handle, message, timeout=30)

    def settle(self) -> bool:
        return wait_read_counts(timeout=30)

    def stats(self) -> rd.LocalStats:
        return rd.local_stats()


def _memory(field: str) -> int:
    """This process's ``field`` of /proc/self/smaps_rollup, in bytes."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


@ray.remote(num_cpus=0, max_concurrency=2)
class LargeOwner:
    """Exports a written buffer (a KV cache: every page resident) and a
    never-written ``torch.empty`` one as one region, and says what its memory
    did after: huge pages gained, resident bytes grown."""

    def __init__(self, mib: int, huge_pages: bool = True) -> None:
        n = mib << 20
        self.written = torch.arange(n // 4, dtype=torch.int32)
        self.unwritten = torch.empty(n, dtype=torch.uint8)
        self.before = {f: _memory(f) for f in ("AnonHugePages", "Rss")}
        self.region = rd.export_region(
            [self.written, self.unwritten], name="large", huge_pages=huge_pages
        )

    def handle(self) -> rd.RegionHandle:
        return self.region.handle()

    def grown(self) -> dict[str, int]:
        return {f: _memory(f) - was for f, was in self.before.items()}


@ray.remote(num_cpus=0)
def read_whole(handle: Any, nbytes: int) -> bool:
    """Whether the first tensor of ``handle``, read whole, holds exactly ``arange``."""
    got = torch.zeros(nbytes // 4, dtype=torch.int32)
    rd.read_ranges(handle, [(0, 0, nbytes, 0, 0)], into=got, timeout=60)
    return torch.equal(got, torch.arange(nbytes // 4, dtype=torch.int32))


@ray.remote(num_cpus=0, max_concurrency=2)
class FreeingOwner:
    """Exports one large tensor as a region, then closes it and frees the memory
    (a block this large is unmapped at once)."""

    def export(self, nbytes: int) -> Any:
        self.tensor = torch.ones(nbytes, dtype=torch.uint8)
        self.region = rd.export_region(self.tensor, huge_pages=False)
        return self.region.handle()

    def close_and_free(self) -> None:
        self.region.close()
        del self.tensor, self.region
