"""Workload 7's actors: trainer ranks that hold rows of every tensor, in one
``torch.distributed`` world over gloo, and workers that hold columns.

A trainer rank holds its rows (``shards.rows_of``: FSDP2's ``Shard(0)``) as
plain tensors and publishes them three ways, one per system: its own rows with
``placement=`` (resharding), to rank 0 with raydirect for rank 0 to publish the
whole (gather then publish), or through ``torch.distributed`` all-gather for
rank 0 to publish the whole. Every rank allocates the whole model too (the
all-gather's output; rank 0's gather buffer), touched once, reused every step.
A worker holds its columns (``shards.columns_of``) and loads either way.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist

import raydirect as rd
from rdbench.common import (
    ACTOR_NUM_CPUS,
    DTYPE,
    ELEMENT_BYTES,
    FREE_TIMEOUT_S,
    SETUP_TIMEOUT_S,
    TRANSFER_TIMEOUT_S,
    Layout,
)
from rdbench.shards import check_shards, columns_of, fill_rows, rows_of, sharded_shape

_LOCALHOST = "127.0.0.1"


class _TrainerRank:
    """Rank ``rank`` of ``world``: ``open_store`` on rank 0, then ``join`` on all at once."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.rows: dict[str, torch.Tensor] = {}
        self.full: dict[str, torch.Tensor] = {}
        self._publishers: dict[tuple[str, str], Any] = {}

    def open_store(self) -> int:
        # Port 0: the kernel picks a free port, so runs beside each other never collide.
        self._store = dist.TCPStore(
            _LOCALHOST, 0, self.world, is_master=True, wait_for_workers=False
        )
        return int(self._store.port)

    def join(self, port: int) -> None:
        if self.rank:
            self._store = dist.TCPStore(_LOCALHOST, port, self.world, is_master=False)
        dist.init_process_group(
            "gloo",
            store=self._store,
            rank=self.rank,
            world_size=self.world,
            timeout=timedelta(seconds=SETUP_TIMEOUT_S),
        )

    def allocate(self, layout: Layout) -> int:
        """This rank's rows of every tensor, and a whole copy of the model (the
        all-gather's output; rank 0's gather buffer), every page touched."""
        self.release()
        self._layout = layout
        for name, shape in layout.items():
            local = sharded_shape(name, shape, self.rank, self.world, rows_of)
            self.rows[name] = torch.empty(local, dtype=DTYPE)
            self.full[name] = torch.zeros(shape, dtype=DTYPE)
        self.prepare(0)  # every page touched now, not in a timed step
        return sum(t.numel() for t in self.rows.values()) * ELEMENT_BYTES

    def _publisher(self, what: str, slots: str) -> Any:
        """The publisher of this rank's rows (``what`` "rows") or of the whole
        ("full"), made on first use (as a trainer makes it once). ``slots``: "copy"
        (depth 2, each version a snapshot), "blocks" (the same, each matrix stored as
        one block of columns per worker: ``shard_blocks``) or "live" (depth 0: no
        copy, the version is the tensors themselves; ``prepare`` waits until no
        handle holds them before it writes them)."""
        publisher = self._publishers.get((what, slots))
        if publisher is None:
            rows = what == "rows"
            publisher = rd.WeightPublisher(
                self.rows if rows else self.full,
                placement=self._placement if rows else None,
                depth=0 if slots == "live" else 2,
                shard_blocks=self._column_blocks if slots == "blocks" else None,
            )
            self._publishers[(what, slots)] = publisher
        return publisher

    def _column_blocks(self, name: str, shape: tuple[int, ...]) -> tuple[int, int] | None:
        # The workers are as many as the ranks: block k is worker k's columns.
        return (1, self.world) if len(shape) > 1 and shape[1] % self.world == 0 else None

    def _placement(self, name: str, local_shape: tuple[int, ...]) -> Any:
        shape = self._layout[name]
        spec = rows_of(name, shape, self.rank, self.world)
        return None if spec is None else (shape, 0, spec[1])

    def prepare(self, seed: int) -> None:
        """The trainer's step: once no object holds its rows or its whole (the
        gather's reads, a depth-0 version), write its rows in place, element i of
        tensor k's global tensor holding i + part_seed(seed, k)."""
        for tensor in self.full.values():
            rd.wait_tensor_freed(tensor, timeout=FREE_TIMEOUT_S)
        for local in self.rows.values():
            rd.wait_tensor_freed(local, timeout=FREE_TIMEOUT_S)
        fill_rows(self.rows, self._layout, seed, self.rank, self.world)

    def publish(self, version: int, slots: str) -> Any:
        """Resharding: this rank's rows, where they lie (``placement=``)."""
        return self._publisher("rows", slots).publish(version, timeout=TRANSFER_TIMEOUT_S)

    @rd.method
    def rows_state(self) -> dict[str, torch.Tensor]:
        """Gather then publish: this rank's rows, for rank 0 to read (a tensor every
        rank holds whole, rank 0 has already)."""
        return {n: t for n, t in self.rows.items() if t.shape != self.full[n].shape}

    def gather_publish(self, refs: list[Any], version: int, slots: str) -> Any:
        """Rank 0: its own rows copied into the whole, every other rank's read
        straight into its place there (``rd.get(into=)``); then the whole published."""
        self._own_rows_into_full()
        into = [self._row_views(rank) for rank in range(1, self.world)]
        rd.get(refs, into=into, timeout=TRANSFER_TIMEOUT_S)
        return self._publisher("full", slots).publish(version, timeout=TRANSFER_TIMEOUT_S)

    def allgather_publish(self, version: int, slots: str) -> Any:
        """Every rank: ``dist.all_gather_single`` of each sharded tensor into the whole
        (one collective per tensor, as ``DTensor.full_tensor()`` gathers a state
        dict); rank 0 then publishes the whole, the others return None."""
        for name, local in self.rows.items():
            if local.shape == self.full[name].shape:  # whole on every rank already
                self.full[name].copy_(local)
            else:
                dist.all_gather_single(self.full[name], local)
        if self.rank:
            return None
        return self._publisher("full", slots).publish(version, timeout=TRANSFER_TIMEOUT_S)

    def _own_rows_into_full(self) -> None:
        views = self._row_views(self.rank)
        with torch.no_grad():
            torch._foreach_copy_(list(views.values()), [self.rows[n] for n in views])

    def _row_views(self, rank: int) -> dict[str, torch.Tensor]:
        """Rank ``rank``'s rows of the whole: contiguous views, by name (rank 0's
        replicated tensors whole, once)."""
        views = {}
        for name, shape in self._layout.items():
            spec = rows_of(name, shape, rank, self.world)
            if spec is not None:
                views[name] = self.full[name][spec[1] : spec[2]]
            elif rank == 0:
                views[name] = self.full[name]
        return views

    def release(self) -> None:
        self._publishers = {}
        self.rows, self.full = {}, {}


TrainerRank: Any = ray.remote(num_cpus=ACTOR_NUM_CPUS)(_TrainerRank)


class _Worker:
    """Worker ``rank`` of ``world``: its columns of every matrix, vectors whole."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self._subscribers: dict[str, Any] = {}

    def allocate(self, layout: Layout) -> int:
        """Its own tensors, touched; returns their bytes (its slice)."""
        self._layout = layout
        self.targets = {
            n: torch.zeros(sharded_shape(n, s, self.rank, self.world, columns_of), dtype=DTYPE)
            for n, s in layout.items()
        }
        self._subscribers = {}
        return sum(t.numel() for t in self.targets.values()) * ELEMENT_BYTES

    def load(self, source: str, handles: Any) -> int:
        """Load from ``handles`` (one per rank, or rank 0's whole); the subscriber is
        kept per ``source`` so that each keeps its plan. Returns the bytes received."""
        sub = self._subscribers.get(source)
        if sub is None:
            shard = self._columns
            sub = self._subscribers[source] = rd.WeightSubscriber(self.targets, shard=shard)
        before = _received()
        sub.load(handles, timeout=TRANSFER_TIMEOUT_S)
        return _received() - before

    def _columns(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        return columns_of(name, shape, self.rank, self.world)

    def check(self, seed: int) -> int:
        """Sampled elements of sampled tensors against the pattern (untimed); the
        bytes held."""
        return check_shards(self.targets, self._layout, seed, self.rank, self.world, columns_of)

    def release(self) -> None:
        self.targets, self._subscribers = {}, {}


def _received() -> int:
    return sum(rd.local_stats().bytes_received.values())


Worker: Any = ray.remote(num_cpus=ACTOR_NUM_CPUS)(_Worker)
