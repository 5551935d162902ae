"""Seals: one 8-byte word per open region or live object, in this process's memory.

A seal holds a value derived from its region's or object's capability while
it is open, and zero once it is closed or freed (``Store.seal``;
``transports.cma`` says how readers use it). Seals live in slabs of plain
memory that are never freed, so a reader checking a seal after its region
closed reads a zero or another's value there, never an unmapped page; a slot
is reused by a later region or object, whose value differs.
"""

from __future__ import annotations

import os
import threading

import numpy as np

_SLAB = 512  # seals per slab (4 KiB)


class Seals:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slabs: list[np.ndarray] = []
        self._free: list[int] = []

    def take(self, value: int) -> tuple[int, int]:
        """A slot holding ``value`` now: (its number, its address)."""
        with self._lock:
            if not self._free:
                first = len(self._slabs) * _SLAB
                self._slabs.append(np.zeros(_SLAB, dtype=np.uint64))
                self._free.extend(reversed(range(first, first + _SLAB)))
            slot = self._free.pop()
            slab, i = divmod(slot, _SLAB)
            self._slabs[slab][i] = value
            return slot, int(self._slabs[slab].ctypes.data) + 8 * i

    def release(self, slot: int) -> None:
        """Zero the slot (its region is closed from now on) and free it for reuse."""
        with self._lock:
            slab, i = divmod(slot, _SLAB)
            self._slabs[slab][i] = 0
            self._free.append(slot)

    def value(self, slot: int) -> int:
        with self._lock:
            slab, i = divmod(slot, _SLAB)
            return int(self._slabs[slab][i])


seals = Seals()


def _forget_after_fork() -> None:
    # The parent's regions are not this process's: start with no seal taken.
    global seals
    seals = Seals()


os.register_at_fork(after_in_child=_forget_after_fork)
