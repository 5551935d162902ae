"""Which bytes of an object's tensors a consumer reads, and where each run lands.

A whole read is one row per tensor. A sharded read (weight sync's tensor
parallelism) asks for slices: rows of a row-major tensor are one run of bytes,
columns are ``count`` runs ``stride`` bytes apart. Rows are kept as numpy
columns so that thousands of them cost array operations, not Python loops:
cross-memory attach turns them into one vector of iovecs, tcp sends them as
one list in the request.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class Ranges:
    """Row ``i`` reads ``count[i]`` runs of ``length[i]`` bytes from tensor
    ``index[i]`` of the object (its flat bytes), the first run at byte
    ``offset[i]`` and each next ``stride[i]`` bytes on, into ``dests[i]`` (a flat
    uint8 tensor of ``count[i] * length[i]`` bytes), back to back. ``devices``:
    the device types the ``dests`` lie on, where the caller says (a transport
    that writes the ``dests`` itself must write there: the orchestration checks)."""

    index: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    count: np.ndarray
    stride: np.ndarray
    dests: Sequence[torch.Tensor]
    whole: bool = False  # one row per tensor of the object, in order, every byte
    devices: frozenset[str] | None = None

    @classmethod
    def of_whole(cls, targets: Sequence[torch.Tensor]) -> Ranges:
        """Every byte of every tensor, tensor ``i`` into ``targets[i]`` (flat uint8
        tensors, or ``ByteViews``, which make them only when a transport needs them)."""
        n = len(targets)
        if isinstance(targets, ByteViews):
            lengths = targets.lengths
        else:
            lengths = np.fromiter((t.numel() for t in targets), dtype=np.int64, count=n)
        zeros = np.zeros(n, dtype=np.int64)
        return cls(
            np.arange(n, dtype=np.int64),
            zeros,
            lengths,
            np.ones(n, np.int64),
            zeros,
            targets,
            whole=True,
        )

    @classmethod
    def of_rows(cls, rows: Sequence[Sequence[int]], dests: list[torch.Tensor]) -> Ranges:
        """From ``(index, offset, length, count, stride)`` rows. Where each row
        lands is read here, once: a weight subscriber reads into the same ranges
        (its plan) every step."""
        table = np.array(rows, dtype=np.int64).reshape(-1, 5)
        index, offset, length, count, stride = (table[:, i].copy() for i in range(5))
        n = len(dests)
        addresses = np.fromiter((d.data_ptr() for d in dests), dtype=np.int64, count=n)
        lengths = np.fromiter((d.numel() for d in dests), dtype=np.int64, count=n)
        landing = ByteViews(addresses, lengths, dests.__getitem__)
        return cls(index, offset, length, count, stride, landing)

    @classmethod
    def requested(cls, rows: Any, sizes: Sequence[int]) -> Ranges:
        """The rows a consumer sent in a request (JSON lists of five ints), checked
        against the sizes of the object's tensors; they land nowhere yet (no
        ``dests``). ``ValueError`` for anything else."""
        if not isinstance(rows, list):
            raise ValueError("the ranges are not a list of rows")
        try:
            table = [[int(v) for v in row] for row in rows]
        except (TypeError, ValueError) as exc:
            raise ValueError(f"a row is not five whole numbers: {exc}") from exc
        if any(len(row) != 5 for row in table):
            raise ValueError("a row is not five whole numbers")
        try:
            ranges = cls.of_rows(table, [])
        except OverflowError as exc:
            raise ValueError("a row holds a number beyond 64 bits") from exc
        ranges.check_within(list(sizes))
        return ranges

    def packed(self, base: int) -> Ranges:
        """These rows landing back to back from address ``base`` (a staging
        buffer of ``nbytes``), in row order."""
        sizes = self.length * self.count
        starts = np.cumsum(sizes) - sizes
        landing = ByteViews(base + starts, sizes, _no_views)
        return Ranges(self.index, self.offset, self.length, self.count, self.stride, landing)

    @property
    def nbytes(self) -> int:
        return int((self.length * self.count).sum())

    def rows(self) -> list[list[int]]:
        """The rows as plain lists (for a JSON request)."""
        table = np.stack([self.index, self.offset, self.length, self.count, self.stride], 1)
        return table.tolist()

    def runs(self, bases: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every run as (source address, destination address, length), where
        tensor ``i``'s bytes start at ``bases[i]``. Empty runs are left out."""
        dest = self.dest_addresses()
        src = bases[self.index] + self.offset
        if bool((self.count == 1).all()):
            keep = self.length > 0
            return src[keep], dest[keep], self.length[keep]
        reps = self.count
        k = np.arange(int(reps.sum()), dtype=np.int64) - np.repeat(np.cumsum(reps) - reps, reps)
        length = np.repeat(self.length, reps)
        src = np.repeat(src, reps) + k * np.repeat(self.stride, reps)
        dest = np.repeat(dest, reps) + k * length
        keep = length > 0
        return src[keep], dest[keep], length[keep]

    def dest_addresses(self) -> np.ndarray:
        """Where each row's bytes land, as addresses (no view made for ``ByteViews``)."""
        if isinstance(self.dests, ByteViews):
            return self.dests.addresses
        return np.fromiter(
            (d.data_ptr() for d in self.dests), dtype=np.int64, count=len(self.dests)
        )

    def check_within(self, sizes: list[int]) -> None:
        """Refuse rows that name no tensor or reach past one (``ValueError``)."""
        n = len(sizes)
        if len(self.index) and (self.index.min() < 0 or self.index.max() >= n):
            raise ValueError("a range names a tensor the object does not have")
        if (self.offset < 0).any() or (self.length < 0).any() or (self.count < 1).any():
            raise ValueError("a range with a negative offset or length, or no runs")
        if (self.stride < 0).any():
            raise ValueError("a range with a negative stride")
        # Step by step, never a sum or product that can wrap around int64: a
        # request's stride near 2**62 made ``offset + (count-1)*stride + length``
        # negative, the row "fitted", and serving it read far outside the tensor.
        room = np.asarray(sizes, dtype=np.int64)[self.index] - self.offset
        if (room < 0).any() or (self.length > room).any():
            raise ValueError("a range reaches past the end of its tensor")
        room -= self.length  # what the later runs of a row may step over
        many = self.count > 1
        if many.any():
            stride, steps = self.stride[many], self.count[many] - 1
            if (stride < self.length[many]).any() or (stride == 0).any():
                raise ValueError("a range's runs overlap: its stride is below its length")
            if (steps > room[many] // stride).any():
                raise ValueError("a range reaches past the end of its tensor")

    def strided_view(self, source: torch.Tensor, row: int) -> torch.Tensor:
        """The bytes row ``row`` reads, as a (count, length) view of ``source``'s flat bytes."""
        return source.as_strided(
            (int(self.count[row]), int(self.length[row])),
            (int(self.stride[row]), 1),
            source.storage_offset() + int(self.offset[row]),
        )


def _no_views(i: int) -> torch.Tensor:
    raise TypeError("these ranges land at raw addresses; copy them with copy_runs")


_COPY_SLICE = 64 << 20  # bytes copied between looks at the caller's deadline


def copy_runs(
    src: np.ndarray, dst: np.ndarray, length: np.ndarray, check: Callable[[], None]
) -> None:
    """``memmove`` each run (addresses in this process), calling ``check`` (which
    raises to stop: a deadline, a closed gate) every ``_COPY_SLICE`` bytes."""
    since_check = 0
    for s, d, n in zip(src.tolist(), dst.tolist(), length.tolist(), strict=True):
        for pos in range(0, n, _COPY_SLICE):
            take = min(_COPY_SLICE, n - pos)
            ctypes.memmove(d + pos, s + pos, take)
            since_check += take
            if since_check >= _COPY_SLICE:
                check()
                since_check = 0


class ByteViews(Sequence[torch.Tensor]):
    """The flat uint8 views of many tensors' bytes, known by address and length;
    view ``i`` is made (once) only when asked for. Cross-memory reads need
    addresses alone (a consumer's receive slots, a producer's tensors), and
    making thousands of views nobody touches would cost more than reading small
    tensors."""

    def __init__(
        self, addresses: np.ndarray, lengths: np.ndarray, view: Callable[[int], torch.Tensor]
    ) -> None:
        self.addresses = addresses
        self.lengths = lengths
        self._view = view
        self._made: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> torch.Tensor:  # type: ignore[override]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        made = self._made.get(i)
        if made is None:
            made = self._made[i] = self._view(i)
        return made


def overlapping(
    starts: np.ndarray, sizes: np.ndarray, kinds: Sequence[str]
) -> tuple[int, int] | None:
    """Two positions whose spans ``[starts, starts + sizes)`` share a byte in the
    memory of one device type (``kinds``), the earlier-starting first; None when
    no two do. Empty spans share nothing. Array operations: 5,000 spans in ~0.1 ms."""
    starts = np.asarray(starts, np.int64)
    sizes = np.asarray(sizes, np.int64)
    named = sorted(set(kinds))
    column = np.asarray(kinds, dtype=object) if len(named) > 1 else None
    for kind in named:
        mine = np.flatnonzero(sizes if column is None else (sizes > 0) & (column == kind))
        if len(mine) < 2:
            continue
        order = mine[np.argsort(starts[mine], kind="stable")]
        ends = starts[order] + sizes[order]
        reach = np.maximum.accumulate(ends)  # the furthest byte any earlier span covers
        hit = np.flatnonzero(starts[order][1:] < reach[:-1])
        if len(hit):
            later = int(order[hit[0] + 1])
            earlier = int(order[np.flatnonzero(ends[: hit[0] + 1] > starts[later])[0]])
            return earlier, later
    return None
