"""Long-lived exported memory moved onto huge pages, for cross-memory readers.

A reader's ``process_vm_readv`` pins every page of the owner's memory it
reads, on the reader's core, one page at a time. From 4 KiB pages that bounds
a read well below a copy: 128 MiB of 512 KiB runs read at 6.7 GB/s here
(20 ms), the same memory on 2 MiB pages at 17 GB/s (7.9 ms), one in-process
copy 5.7 ms (``docs/regions.md``, "Huge pages"). A region (a KV cache, a
staging buffer) is read again and again for as long as it lives, so its
memory is worth moving onto huge pages once: ``MADV_COLLAPSE`` (Linux 6.1+)
copies each 2 MiB of small pages onto one huge page in place: contents,
addresses and tensors unchanged, whatever the process's THP setting (bar
``never``).

It costs 0.03-2.3 ms per MiB (the high end when the kernel must first compact
memory for free huge pages), so it runs on a thread of its own, at the lowest
priority, 32 MiB at a time: the region is readable at once, and its reads get
faster as the collapse goes on. Only 2 MiB pieces whose every page is already
resident are collapsed: a collapse fills the pages it finds missing, and an
exported ``torch.empty`` buffer never written must not grow by its whole size.
Objects (``rd.method``, ``rd.put``) are not collapsed: each is read once or a
few times, and collapsing costs more than those reads save.

Where the kernel cannot (older than 6.1, THP ``never``, memory locked), the
memory stays as it is: reads are as fast as they were.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import threading
from collections.abc import Callable

import numpy as np

HUGE_PAGE = 2 << 20
_SMALL_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MADV_COLLAPSE = 25
_STEP = 32 << 20  # bytes per madvise call: a closed region stops within one step
_LOWEST_PRIORITY = 19

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]

# (address, length, still wanted) of memory to collapse, in export order.
_jobs: queue.SimpleQueue[tuple[int, int, Callable[[], bool]]] = queue.SimpleQueue()
_worker: threading.Thread | None = None
_worker_lock = threading.Lock()


def collapse_later(spans: list[tuple[int, int]], wanted: Callable[[], bool]) -> None:
    """Move the resident 2 MiB pieces of ``spans`` ((address, length) of host
    memory) onto huge pages, on the collapsing thread, while ``wanted()`` says
    the memory is still exported. Returns at once."""
    for address, length in spans:
        if length >= HUGE_PAGE:
            _jobs.put((address, length, wanted))
    _ensure_worker()


def collapse(address: int, length: int, wanted: Callable[[], bool] = lambda: True) -> int:
    """Collapse the resident 2 MiB pieces of ``[address, address + length)`` now;
    returns the bytes the kernel moved onto huge pages (0 where it cannot)."""
    moved = 0
    for start, size in _resident_pieces(address, length):
        for at in range(start, start + size, _STEP):
            if not wanted():
                return moved
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


def _ensure_worker() -> None:
    global _worker
    with _worker_lock:
        if _worker is None or not _worker.is_alive():
            _worker = threading.Thread(target=_run, name="raydirect-huge-pages", daemon=True)
            _worker.start()


def _run() -> None:
    with contextlib.suppress(OSError, AttributeError):  # a nice thread where Linux allows one
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _LOWEST_PRIORITY)
    while True:
        address, length, wanted = _jobs.get()
        if wanted():
            collapse(address, length, wanted)


def _forget_after_fork() -> None:
    global _worker, _worker_lock, _jobs
    _worker, _worker_lock, _jobs = None, threading.Lock(), queue.SimpleQueue()


os.register_at_fork(after_in_child=_forget_after_fork)
