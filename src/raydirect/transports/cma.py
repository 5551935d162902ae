"""``cma``: same node, the consumer reads the producer's tensor memory directly.

Cross-memory attach (``process_vm_readv``) copies from the producer's address
space into the consumer's receive buffer in one step: one copy in all, nothing
done by the producer, no segment. Measured here between two Ray workers:
7-9 GB/s into touched or huge-page memory. It needs ptrace-read permission
over the producer (same user; where Yama restricts ptrace, the producer's
agent allows it with ``PR_SET_PTRACER_ANY`` at start). Where the kernel
refuses, this raises ``TransportUnavailableError`` and ``auto`` uses ``shm``.

A region (``rd.export_region``) is read while its owner may close it, and the
owner may reuse the memory once ``close`` returns; a reader may hold an
object's Payload after its free (Ray keeps a borrowed value whose owner died,
and that death freed the object). So each read checks the object's or
region's *seal* (``_region_seals``) before it starts (a closed region, or a
handle whose id or capability is not the region's, reads nothing) and again
after its last byte has landed: if the seal still holds then, every byte is
the object's, never memory its owner had handed to something else. A region's
seal covers its extent too (its tensors' addresses and sizes, which its
handle carries outside Ray): a handle whose ``ptrs`` or ``nbytes`` were edited
reads nothing, for no agent checks a ``cma`` read's ranges.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from raydirect import _compression as compression
from raydirect._process import process_vm_readv
from raydirect._ranges import ByteViews, Ranges
from raydirect.errors import (
    ProducerLostError,
    TransferError,
    TransportUnavailableError,
)
from raydirect.transports.base import (
    ByteTransport,
    PeerMetadata,
    ReadSeal,
    TensorTransportMetadata,
)

_IOV_MAX = 1024
_CALL_BYTES = 16 << 20  # bytes per system call: a deadline is noticed, threads share evenly
_BYTES_PER_THREAD = 32 << 20
_MAX_AUTO_THREADS = 4
_MAX_THREADS = 16
THREADS_ENV = "RAYDIRECT_CMA_THREADS"
_JOIN_GAP = 4096  # runs at most this far apart are read as one span (see _Spans)
_JOIN_RUN = 64 << 10  # runs this long are read on their own: their vector costs little
_JOIN_MAX = 512  # runs per span, so that a span's local vectors fit one call
_FEW_TENSORS = 64  # a whole object of at most this many tensors ...
_FEW_BYTES = 16 << 20  # ... and bytes is read in one call, with no plan (_read_few)
_FEW_RUNS = 64  # so is a ranged read of at most this many runs (and bytes)
_scratch = np.empty(_JOIN_GAP, dtype=np.uint8)  # where the gaps go; never read
_workers: ThreadPoolExecutor | None = None
_workers_lock = threading.Lock()


_readv = process_vm_readv
# The same call holding the GIL, for reads of at most _FEW_BYTES in one call
# (0.5-2.5 ms; Python itself lets a thread hold the GIL for its 5 ms switch
# interval): a call that lets the GIL go waits up to that interval to have it
# back while another thread runs Python (a vLLM worker's loop beside its KV
# reads). Beside a busy thread an 8 MiB read took 6.6-10.7 ms
# with four such waits, 5.9 with one, and takes its 0.3-0.8 ms with none.
_readv_holding_gil = ctypes.PyDLL(None, use_errno=True).process_vm_readv
_readv_holding_gil.argtypes = _readv.argtypes
_readv_holding_gil.restype = ctypes.c_ssize_t


def _split_long(src: np.ndarray, dst: np.ndarray, length: np.ndarray):
    """Cut runs longer than ``_CALL_BYTES`` so a deadline is noticed between calls."""
    if not len(length) or int(length.max()) <= _CALL_BYTES:
        return src, dst, length
    parts = (length + _CALL_BYTES - 1) // _CALL_BYTES
    k = np.arange(int(parts.sum()), dtype=np.int64) - np.repeat(np.cumsum(parts) - parts, parts)
    start = k * _CALL_BYTES
    pieces = np.minimum(np.repeat(length, parts) - start, _CALL_BYTES)
    return np.repeat(src, parts) + start, np.repeat(dst, parts) + start, pieces


def _batches(length: np.ndarray):
    """(first, last) rows of each system call: at most ``_IOV_MAX`` vectors and
    about ``_CALL_BYTES`` bytes."""
    return _calls(np.arange(1, len(length) + 1), np.cumsum(length), len(length))


def _calls(vectors: np.ndarray, ends: np.ndarray, n: int):
    """(first, last) spans of each system call, given the cumulative local vectors
    and bytes after each span: at most ``_IOV_MAX`` vectors and spans, about
    ``_CALL_BYTES`` bytes, at least one span."""
    first = 0
    while first < n:
        base_v = vectors[first - 1] if first else 0
        base_b = ends[first - 1] if first else 0
        by_vectors = int(np.searchsorted(vectors, base_v + _IOV_MAX, side="right"))
        by_bytes = int(np.searchsorted(ends, base_b + _CALL_BYTES, side="right"))
        last = min(n, first + _IOV_MAX, max(min(by_bytes, by_vectors), first + 1))
        yield first, last
        first = last


class _Spans:
    """Runs joined into spans of the producer's memory: runs less than
    ``_JOIN_GAP`` bytes apart are read as one span, the bytes between them going
    to a scratch buffer. The kernel pins the pages of every remote vector on its
    own (about 1 µs a vector here), more than copying 4 KiB costs, so the
    thousands of short runs of a row-parallel shard, or of small tensors that lie
    back to back, cost a few vectors. Local vectors are cheap; runs are taken in
    the producer's address order."""

    def __init__(self, src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> None:
        src, dst, length = _split_long(src, dst, length)
        if len(src) > 1 and bool((src[1:] < src[:-1]).any()):
            # In the producer's address order, so neighbours there can join
            # (a shard's blocks and the replicated tensors between them).
            order = np.argsort(src, kind="stable")
            src, dst, length = src[order], dst[order], length[order]
        self.runs = (src, dst, length)
        n = len(length)
        if n == 0:  # only empty tensors: no span, no system call
            src = dst = length = np.zeros(1, dtype=np.int64)[:0]
            self.first = self.last = self.local_ends = self.byte_ends = src
            self.local = self.remote = np.zeros((0, 2), dtype=np.uint64)
            return
        gap = src[1:] - (src[:-1] + length[:-1])
        short = length < _JOIN_RUN
        join = (gap >= 0) & (gap <= _JOIN_GAP) & short[:-1] & short[1:]
        starts = np.concatenate(([True], ~join))
        group = np.cumsum(starts) - 1
        position = np.arange(n) - np.flatnonzero(starts)[group]
        starts |= position % _JOIN_MAX == 0  # a span's vectors fit one call
        self.first = np.flatnonzero(starts)
        self.last = np.append(self.first[1:], n) - 1
        has_gap = np.ones(n, dtype=bool)
        has_gap[self.last] = False
        per_run = 1 + has_gap.astype(np.int64)
        row = np.cumsum(per_run) - per_run  # each run's local vector
        self.local = np.empty((int(per_run.sum()), 2), dtype=np.uint64)
        self.local[row, 0], self.local[row, 1] = dst, length
        gapped = np.flatnonzero(has_gap)
        self.local[row[gapped] + 1, 0] = _scratch.ctypes.data
        self.local[row[gapped] + 1, 1] = gap[gapped]
        start = src[self.first]
        span = src[self.last] + length[self.last] - start
        self.remote = np.stack([start, span], 1).astype(np.uint64)
        self.local_ends = row[self.last] + 1  # local vectors up to each span's end
        self.byte_ends = np.cumsum(span)


def threads_for(nbytes: int) -> int:
    """Threads for one read: ``RAYDIRECT_CMA_THREADS`` when set, else one per
    ``_BYTES_PER_THREAD``, at most one per core and ``_MAX_AUTO_THREADS``. The
    kernel pins every 4 KiB page of a cross-memory read on the reader's core,
    which bounds a read of memory without huge pages (a model's many small
    tensors) by one core; a second thread takes the second core. Huge-page
    memory reads at memory speed from one thread: a second one changes nothing."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if raw:
        try:
            configured = int(raw)
        except ValueError:
            configured = -1
        if not 0 <= configured <= _MAX_THREADS:
            raise ValueError(
                f"{THREADS_ENV}={raw!r}: expected a whole number from 0 to {_MAX_THREADS} "
                "(0 or 1: one thread), or unset it to choose by size"
            )
        return max(1, configured)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(nbytes // _BYTES_PER_THREAD, cores or 1, _MAX_AUTO_THREADS))


def _pool() -> ThreadPoolExecutor:
    global _workers
    with _workers_lock:  # made once, whatever the number of threads that race here
        if _workers is None:
            _workers = ThreadPoolExecutor(_MAX_THREADS, thread_name_prefix="raydirect-cma")
        return _workers


def read_remote(pid: int, spans: _Spans, link: PeerMetadata) -> None:
    """Copy every run of ``spans`` from ``pid``: its system calls shared among
    ``threads_for`` threads (this one takes the first share), each share a run
    of consecutive calls of about equal bytes."""
    calls = list(_calls(spans.local_ends, spans.byte_ends, len(spans.first)))
    total = int(spans.byte_ends[-1]) if len(spans.byte_ends) else 0
    threads = min(threads_for(total), len(calls))
    if threads <= 1:
        _read_calls(pid, spans, calls, link)
        return
    ends = [int(spans.byte_ends[last - 1]) for _, last in calls]
    cuts = [0, *(bisect.bisect_left(ends, total * k // threads) + 1 for k in range(1, threads))]
    shares = [calls[a:b] for a, b in zip(cuts, [*cuts[1:], len(calls)], strict=True) if a < b]
    futures = [_pool().submit(_read_calls, pid, spans, share, link) for share in shares[1:]]
    errors: list[BaseException] = []
    try:
        _read_calls(pid, spans, shares[0], link)
    except BaseException as exc:
        errors.append(exc)
    for future in futures:  # every share finished before anyone frees the destination
        try:
            future.result()
        except BaseException as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


def _read_calls(pid: int, spans: _Spans, calls: list[tuple[int, int]], link: PeerMetadata) -> None:
    src, dst, length = spans.runs
    for first, last in calls:
        link.check_deadline()
        local_first = int(spans.local_ends[first - 1]) if first else 0
        expected = int(spans.remote[first:last, 1].sum())
        got = _readv(
            pid,
            spans.local[local_first:].ctypes.data,
            int(spans.local_ends[last - 1]) - local_first,
            spans.remote[first:].ctypes.data,
            last - first,
            0,
        )
        if got != expected:  # cut short: read these runs one by one, which says why
            runs = slice(int(spans.first[first]), int(spans.last[last - 1]) + 1)
            _read_runs(pid, src[runs], dst[runs], length[runs], link)


def _read_runs(
    pid: int, src: np.ndarray, dst: np.ndarray, length: np.ndarray, link: PeerMetadata
) -> None:
    local = np.stack([dst, length], 1).astype(np.uint64)
    remote = np.stack([src, length], 1).astype(np.uint64)
    for first, last in _batches(length):
        link.check_deadline()
        while first < last:
            n = last - first
            got = _readv(pid, local[first:].ctypes.data, n, remote[first:].ctypes.data, n, 0)
            if got <= 0:
                _raise_for(got, link.who)
            # A partial read stops at a run boundary or inside one: skip what arrived.
            while got > 0:
                ln = int(local[first, 1])
                if got >= ln:
                    got -= ln
                    first += 1
                else:
                    for vec in (local, remote):
                        vec[first, 0] += got
                        vec[first, 1] -= got
                    got = 0


def _raise_for(got: int, who: str) -> None:
    if got == 0:
        raise TransferError(f"reading {who}'s memory returned no data")
    err = ctypes.get_errno()
    if err == errno.ESRCH:
        raise ProducerLostError.of(who, "died")
    if err == errno.EPERM:
        raise TransportUnavailableError(
            f"the kernel refuses cross-memory reads from {who} (EPERM): use "
            "tensor_transport='shm', or allow ptrace between processes of one "
            "user (kernel.yama.ptrace_scope=0)"
        )
    raise TransferError(f"reading {who}'s memory failed: {os.strerror(err)}")


def _pack_addresses(addresses: np.ndarray) -> bytes:
    """Tensor addresses as the Payload carries them: each the step from the one
    before, compressed. Tensors allocated one after another lie close, so 5,000
    of them take 4 KB instead of 40 (the Payload stays under Ray's inline limit)."""
    steps = addresses.astype("<i8")  # a copy: np.diff costs 30 µs on a few
    steps[1:] -= addresses[:-1]
    return compression.pack(steps.tobytes())


def _addresses(packed: bytes) -> np.ndarray:
    try:
        steps = np.frombuffer(compression.unpack(packed), dtype="<i8")
    except (ValueError, TypeError) as exc:
        raise TransferError(f"corrupt cma metadata: {exc}") from exc
    return np.cumsum(steps, dtype=np.int64)


class CmaTransport(ByteTransport):
    name = "cma"
    one_sided = True
    devices = ("cpu",)
    same_node_only = True
    notify_sent = True  # the producer does nothing in a read: tell it
    ranged = True
    sealed = True

    def extract_tensor_transport_metadata(
        self, obj_id: bytes, tensors: list[torch.Tensor]
    ) -> TensorTransportMetadata:
        # The producer's tensors come as ByteViews: their addresses, no view made.
        addresses = (
            tensors.addresses
            if isinstance(tensors, ByteViews)
            else np.array([t.data_ptr() for t in tensors], dtype=np.int64)
        )
        return TensorTransportMetadata(tensor_meta=[], extra={"ptrs": _pack_addresses(addresses)})

    def receive(
        self, obj_id: bytes, extra: dict[str, Any], link: PeerMetadata, ranges: Ranges
    ) -> None:
        # A pid names the producer only while it runs: a reused pid is another process.
        link.check_alive()
        pid, seal = link.producer.pid, ReadSeal.of(obj_id, extra, link)
        if seal is not None:  # nothing read once it is freed or closed ...
            seal.check()
        addresses = _addresses(extra["ptrs"])
        try:
            if not _read_few(pid, addresses, ranges, link):
                read_remote(pid, _Spans(*ranges.runs(addresses)), link)
        except TransferError:
            if seal is not None:  # memory unmapped by a free or a close's reuse: say so
                seal.check()
            raise
        if seal is not None:  # ... nor while it was being freed
            seal.check()


def _read_few(pid: int, addresses: np.ndarray, ranges: Ranges, link: PeerMetadata) -> bool:
    """A whole object of a few tensors (a medium transfer), or a ranged read of a
    few runs (a short prompt's KV blocks: a run per layer), in one system call,
    vectors straight from the addresses: planning spans for it cost 70-110 us
    here, more than reading 1 MiB. False when the read is not such a read, or
    came up short: the general path then reads it all again, and says why."""
    if ranges.whole:
        if len(addresses) > _FEW_TENSORS:
            return False
        src, dst, length = addresses, ranges.dest_addresses(), ranges.length
    else:
        if len(ranges.length) > _FEW_RUNS:
            return False
        src, dst, length = ranges.runs(addresses)
        if len(length) > _FEW_RUNS:
            return False
    total = int(length.sum())
    if total > _FEW_BYTES:
        return False
    link.check_deadline()
    n = len(length)
    local = np.empty((n, 2), dtype=np.uint64)
    remote = np.empty((n, 2), dtype=np.uint64)
    local[:, 0], remote[:, 0] = dst, src
    local[:, 1] = remote[:, 1] = length
    return int(_readv_holding_gil(pid, local.ctypes.data, n, remote.ctypes.data, n, 0)) == total


def _forget_after_fork() -> None:
    global _workers, _workers_lock
    _workers, _workers_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
