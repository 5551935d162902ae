"""Long-lived exported memory moved onto huge pages, for cross-memory readers.

A reader's ``process_vm_readv`` pins every page of the owner's memory it
reads, on the reader's core, one page at a time. From 4 KiB pages that bounds
a read of long runs well below a copy: 128 MiB of 512 KiB runs read at 6.7 GB/s
here (20 ms), the same memory on 2 MiB pages at 17 GB/s (7.9 ms), one
in-process copy 5.7 ms; a vLLM engine's 2,048-token KV read 27.6 -> 14.2 ms
(docs/regions.md, "Huge pages"; runs of 8 KiB gain nothing). A region (a KV cache, a staging
buffer) is read again and again for as long as it lives, so its memory is
worth moving onto huge pages once, when it is exported: ``MADV_COLLAPSE``
(Linux 6.1+) copies each 2 MiB of small pages onto one huge page in place:
contents, addresses and tensors unchanged, whatever the process's THP setting
(bar ``never``).

At export, not on a thread behind it: a collapse running under reads slowed
them 3x (an 8 MiB KV read 1.9 -> 5.4 ms in workload 11 while the engines'
1 GiB caches were collapsing), and at the lowest priority it took a minute on a
busy machine. It costs 0.03-2.3 ms per MiB (the high end when the kernel must
first compact memory for free huge pages). Only 2 MiB pieces whose every page
is already resident are collapsed: a collapse fills the pages it finds
missing, and an exported ``torch.empty`` buffer never written must not grow by
its whole size. Objects (``rd.method``, ``rd.put``) are not collapsed: each is
read once or a few times, and collapsing costs more than those reads save.

Where the kernel cannot (older than 6.1, THP ``never``, memory locked), the
memory stays as it is: reads are as fast as they were.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

HUGE_PAGE = 2 << 20
_SMALL_PAGE = os.sysconf("SC_PAGE_SIZE")
_MADV_COLLAPSE = 25
_STEP = 64 << 20  # bytes per madvise call: one that fails (EAGAIN) loses little

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def collapse(address: int, length: int) -> int:
    """Move the resident 2 MiB pieces of ``[address, address + length)`` (host
    memory of this process) onto huge pages; returns the bytes the kernel moved
    (0 where it cannot)."""
    moved = 0
    for start, size in _resident_pieces(address, length):
        for at in range(start, start + size, _STEP):
            step = min(_STEP, start + size - at)
            if _libc.madvise(at, step, _MADV_COLLAPSE) == 0:
                moved += step
    return moved


def _resident_pieces(address: int, length: int) -> list[tuple[int, int]]:
    """Runs of whole aligned 2 MiB pieces of the span whose pages are all resident."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + length) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return []
    pages = np.zeros((end - start) // _SMALL_PAGE, dtype=np.uint8)
    if _libc.mincore(start, end - start, pages.ctypes.data) != 0:
        return []  # not memory this process maps as it should: leave it be
    full = (pages.reshape(-1, HUGE_PAGE // _SMALL_PAGE) & 1).all(axis=1)
    edges = np.flatnonzero(np.diff(np.concatenate(([0], full.astype(np.int8), [0]))))
    return [
        (start + int(a) * HUGE_PAGE, (int(b) - int(a)) * HUGE_PAGE)
        for a, b in zip(edges[::2], edges[1::2], strict=True)
    ]
