"""``shm``: same node, through a shared-memory segment: one copy in, one copy out.

On the first request for an object the producer's agent copies its tensors
into a segment from a per-process pool; every consumer on the node then
copies out of it. A new segment is slow to fill the first time (tmpfs page
allocation, 0.24-0.6 GB/s here) while rewriting one runs at 9-15 GB/s, so
segments are pooled and reused, never made per object on a hot path.

A region's bytes change between reads (``rd.export_region``), so a staged copy
would go stale: each read of one (its metadata says ``live``) is copied by the
owner's agent, at the read, into a pooled segment of the *reader's* (named in
the request), only the rows asked for, back to back; the reader copies them
out. The reader owns that segment: no release message, and a read that failed
or gave up (its segment may still be written) discards it instead of reusing it.
The request carries 16 random bytes the reader wrote at the segment's end, and
the agent writes only into a segment that ends with them: a peer that cannot
read this node's segments (another node's, holding only a region's handle)
cannot make the agent write into a segment of anyone else's.

A segment is named ``rd-<pid>-<start time>-<n>``: a process killed without
clean-up leaves files nobody would unlink, so every process that starts an
agent, and every consumer that finds a same-node producer dead, removes the
segments of processes that no longer run.
"""

from __future__ import annotations

import atexit
import contextlib
import hmac
import itertools
import logging
import mmap
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from raydirect import _process
from raydirect._channel import channel
from raydirect._ranges import Ranges, copy_runs
from raydirect._tensors import arena_layout
from raydirect.errors import ProducerLostError, TransferError
from raydirect.transports.base import ByteTransport, Delivered, PeerMetadata

if TYPE_CHECKING:
    from raydirect._server import Reply
    from raydirect._store import StoredObject

log = logging.getLogger("raydirect")

SHM_DIR = "/dev/shm"
PREFIX = "rd-"
_MIN_SEGMENT = 1 << 20
_IDLE_CAP_BYTES = 2 << 30  # idle segments kept for reuse, per process
_COPY_SLICE = 64 << 20  # copies are cut so a deadline is noticed
_MAPPED_SEGMENTS = 8  # consumer: segments kept mapped for reuse
_SWEEP_S = 0.5  # consumer: how often mapped segments are checked for unlinking
# A staged segment ends with the id of the object it holds, written after its
# bytes and zeroed when the segment goes back to the pool. A consumer checks it
# before and after it copies out, as a seqlock's reader does: a copy that raced
# the object's free and another object's staging there raises instead of
# returning those bytes. Such a free comes while a reader holds a ref when Ray
# hands a borrower a value whose owner died, and that death freed the object.
_TAG = 16


def segment_size(nbytes: int) -> int:
    """Round up to a size class (at most 1/8 waste) so segments are reusable."""
    n = max(nbytes, _MIN_SEGMENT)
    step = 1 << max(n.bit_length() - 4, 12)
    return (n + step - 1) // step * step


def _map(path: str, size: int, create: bool) -> mmap.mmap:
    # O_NOFOLLOW: /dev/shm is world-writable; a name must never lead elsewhere.
    flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _copy_sliced(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Stage ``src`` into ``dst`` in slices (the agent's staging copy)."""
    for start in range(0, src.numel(), _COPY_SLICE):
        dst[start : start + _COPY_SLICE].copy_(src[start : start + _COPY_SLICE])


@dataclass
class Segment:
    name: str
    size: int
    view: torch.Tensor  # uint8 over the whole mapping; owns the mmap


class SegmentPool:
    """The producer's segments: in use (by object id) and idle (for reuse)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[Segment] = []
        self._used: dict[bytes, Segment] = {}
        self._counter = 0
        self._prefix = f"{PREFIX}{_process.PID}-{_process.START_TIME}-"
        self._pid = _process.PID
        atexit.register(self.unlink_all)

    def acquire(self, obj_id: bytes, nbytes: int) -> Segment:
        with self._lock:
            fits = [s for s in self._idle if nbytes <= s.size <= 2 * max(nbytes, _MIN_SEGMENT)]
            if fits:
                seg = min(fits, key=lambda s: s.size)
                self._idle.remove(seg)
            else:
                self._counter += 1
                name = f"{self._prefix}{self._counter}"
                size = segment_size(nbytes)
                seg = Segment(
                    name,
                    size,
                    torch.frombuffer(
                        _map(os.path.join(SHM_DIR, name), size, create=True), dtype=torch.uint8
                    ),
                )
            self._used[obj_id] = seg
            return seg

    def release(self, obj_id: bytes) -> None:
        with self._lock:
            seg = self._used.pop(obj_id, None)
            if seg is None:
                return
            seg.view[seg.size - _TAG :].zero_()  # no longer the object's (``_TAG``)
            self._idle.append(seg)
            idle = sum(s.size for s in self._idle)
            while idle > _IDLE_CAP_BYTES and self._idle:
                oldest = self._idle.pop(0)
                idle -= oldest.size
                self._unlink(oldest.name)

    def discard(self, key: bytes) -> None:
        """Drop a segment in use for good: another process may still write it."""
        with self._lock:
            seg = self._used.pop(key, None)
        if seg is not None:
            self._unlink(seg.name)

    def segment_names(self) -> list[str]:
        with self._lock:
            return [s.name for s in (*self._idle, *self._used.values())]

    @staticmethod
    def _unlink(name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))

    def unlink_all(self) -> None:
        if self._pid != os.getpid():  # a forked child: the segments are its parent's
            return
        for name in self.segment_names():
            self._unlink(name)


def sweep_after_shutdown(timeout: float = 10.0) -> None:
    """After ``ray.shutdown()`` killed this node's workers, which could not unlink
    their segments: remove those segments once the processes are gone (what the
    next raydirect process on the node would do), waiting up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        sweep_dead_segments()
        if not any(name.startswith(PREFIX) for name in os.listdir(SHM_DIR)):
            return
        if time.monotonic() >= deadline:
            return
        time.sleep(0.1)  # the killed workers are still exiting


def sweep_dead_segments(pid: int | None = None) -> int:
    """Unlink segments of processes on this node that no longer run (only
    ``pid``'s when given). Returns how many were removed."""
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            owner, start, _ = name[len(PREFIX) :].split("-", 2)
            owner_pid, start_time = int(owner), int(start)
        except ValueError:
            continue
        if pid is not None and owner_pid != pid:
            continue
        if not _process.process_alive(owner_pid, start_time):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
                removed += 1
    return removed


class _MappedSegments:
    """Consumer side: recently used producer segments stay mapped (mapping costs
    page-table work on every first touch)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._swept = 0.0

    def view(self, name: str, size: int) -> torch.Tensor:
        with self._lock:
            self._sweep()
            view = self._maps.get(name)
            if view is not None and view.numel() == size:
                self._maps.move_to_end(name)
                return view
        view = torch.frombuffer(
            _map(os.path.join(SHM_DIR, name), size, create=False), dtype=torch.uint8
        )
        with self._lock:
            self._maps[name] = view
            while len(self._maps) > _MAPPED_SEGMENTS:
                self._maps.popitem(last=False)  # unmapped once no copy uses it
        return view

    def _sweep(self) -> None:
        """Unmap segments unlinked since (their producer died, or freed them): they
        keep their memory while mapped here. At most every ``_SWEEP_S``, also when
        every read finds its segment mapped already."""
        now = time.monotonic()
        if now - self._swept < _SWEEP_S:
            return
        self._swept = now
        for gone in [n for n in self._maps if not os.path.exists(os.path.join(SHM_DIR, n))]:
            del self._maps[gone]


def _checked_reply(header: dict[str, Any], ranges: Ranges, who: str) -> tuple[str, int, np.ndarray]:
    """The segment a reply names, refusing anything that could make this process
    open another file or read past the segment."""
    try:
        name, size = str(header["segment"]), int(header["size"])
        offsets = np.array([int(o) for o in header["offsets"]], dtype=np.int64)
    except (KeyError, TypeError, ValueError) as exc:
        raise TransferError(f"corrupt reply from {who}: {exc}") from exc
    if not name.startswith(PREFIX) or "/" in name or name in (".", ".."):
        raise TransferError(f"corrupt reply from {who}: bad segment name {name!r}")
    if ranges.whole and len(offsets) != len(ranges.dests):
        raise TransferError(f"corrupt reply from {who}: tensor offsets outside the segment")
    if len(ranges.index) and int(ranges.index.max()) >= len(offsets):
        raise TransferError(f"corrupt reply from {who}: tensor offsets outside the segment")
    ends = ranges.offset + (ranges.count - 1) * ranges.stride + ranges.length
    room = size - _TAG
    if len(offsets) and ((offsets < 0).any() or (offsets[ranges.index] + ends > room).any()):
        raise TransferError(f"corrupt reply from {who}: tensor offsets outside the segment")
    return name, size, offsets


def _check_tag(tag: np.ndarray, obj_id: bytes, who: str) -> None:
    """``ProducerLostError`` unless a staged segment still holds ``obj_id`` (``_TAG``)."""
    if tag.tobytes() != obj_id:
        raise ProducerLostError.freed_while_held(who)


_MARK = 16  # bytes of the reader's mark at its segment's end


def _segment_named(into: Any) -> tuple[str, int, bytes]:
    """The reader's segment a region's read names (``[name, size, mark]``),
    refusing anything that could make the agent open another file."""
    try:
        name, size, mark = str(into[0]), int(into[1]), bytes.fromhex(into[2])
    except (TypeError, ValueError, IndexError, KeyError) as exc:
        raise ValueError(f"a bad segment in the request: {exc}") from exc
    if not name.startswith(PREFIX) or "/" in name or name in (".", ".."):
        raise ValueError(f"a bad segment in the request: {name!r}")
    if size <= _MARK or len(mark) != _MARK:
        raise ValueError("a bad segment in the request: no room for its mark")
    return name, size, mark


class ShmTransport(ByteTransport):
    name = "shm"
    one_sided = True
    devices = ("cpu",)
    same_node_only = True
    ranged = True  # the segment holds the whole object; each consumer copies out its ranges

    def __init__(self) -> None:
        self._pool: SegmentPool | None = None
        self._mapped = _MappedSegments()
        self._given = _MappedSegments()  # the readers' segments a region's reads land in
        self._reads = itertools.count()

    def _segments(self) -> SegmentPool:
        if self._pool is None:
            self._pool = SegmentPool()
        return self._pool

    def serve(
        self, obj: StoredObject, request: dict[str, Any], reply: Reply, delivered: Delivered
    ) -> None:
        if "into" in request:
            delivered(self._serve_into(obj, request, reply))
            return
        with obj.lock:  # consumers arriving together share one staging copy
            if obj.freed:  # after its free released its state: a segment would leak
                raise ProducerLostError.freed_meanwhile()
            state = obj.transport_state.get(self.name)
            if state is None:
                offsets, total = arena_layout(obj.metas)
                seg = self._segments().acquire(obj.obj_id, total + _TAG)
                for buf, off in zip(obj.buffers, offsets, strict=True):
                    _copy_sliced(seg.view[off : off + buf.numel()], buf)
                seg.view[seg.size - _TAG :].numpy()[:] = np.frombuffer(obj.obj_id, np.uint8)
                state = {"segment": seg.name, "size": seg.size, "offsets": offsets}
                obj.transport_state[self.name] = state
        reply.send({"ok": True, **state})
        asked = request.get("nbytes")  # what the consumer copies out (all, or its ranges)
        delivered(min(int(asked), obj.nbytes) if isinstance(asked, int) else obj.nbytes)

    def _serve_into(self, obj: StoredObject, request: dict[str, Any], reply: Reply) -> int:
        """A region's read: copy the rows asked for, now, into the reader's segment."""
        name, size, mark = _segment_named(request.get("into"))
        ranges = Ranges.requested(request.get("ranges"), obj.buffers.lengths.tolist())
        if ranges.nbytes > size - _MARK:
            raise ValueError(f"the reader's segment holds {size} bytes, the rows {ranges.nbytes}")
        view = self._given.view(name, size)
        if not hmac.compare_digest(view[size - _MARK :].numpy().tobytes(), mark):
            raise ValueError(f"segment {name!r} does not carry the reader's mark")
        packed = ranges.packed(view.data_ptr())
        copy_runs(*packed.runs(obj.buffers.addresses), lambda: None)
        reply.send({"ok": True, "copied": ranges.nbytes})
        return ranges.nbytes

    def garbage_collect(self, obj_id: bytes, meta: Any, tensors: Sequence[torch.Tensor]) -> None:
        if self._pool is not None:
            self._pool.release(obj_id)

    def receive(
        self, obj_id: bytes, extra: dict[str, Any], link: PeerMetadata, ranges: Ranges
    ) -> None:
        if extra.get("live"):
            self._receive_live(obj_id, link, ranges)
            return
        who = link.who
        with channel(link.producer.agent_address) as ch:
            header, _ = self.ask_producer(ch, obj_id, link, nbytes=ranges.nbytes)
        name, size, offsets = _checked_reply(header, ranges, who)
        try:
            seg = self._mapped.view(name, size)
        except (OSError, ValueError) as exc:  # no such segment, or smaller than the reply says
            link.check_alive("died (its segment is gone)")
            raise TransferError(f"corrupt reply from {who}: segment {name!r}: {exc}") from exc
        tag = seg[size - _TAG :].numpy()
        _check_tag(tag, obj_id, who)
        copy_runs(*ranges.runs(seg.data_ptr() + offsets), link.check_deadline)
        _check_tag(tag, obj_id, who)

    def _receive_live(self, obj_id: bytes, link: PeerMetadata, ranges: Ranges) -> None:
        """A region's read: the owner's agent copies the rows into a segment of
        ours, then we copy them out (see the module's docstring)."""
        key = f"read-{next(self._reads)}".encode()
        pool = self._segments()
        seg = pool.acquire(key, ranges.nbytes + _MARK)
        mark = secrets.token_bytes(_MARK)
        seg.view[seg.size - _MARK :] = torch.frombuffer(bytearray(mark), dtype=torch.uint8)
        done = False
        try:
            with channel(link.producer.agent_address) as ch:
                asked = {"into": [seg.name, seg.size, mark.hex()], "ranges": ranges.rows()}
                header, _ = self.ask_producer(ch, obj_id, link, **asked)
            if header.get("copied") != ranges.nbytes:
                raise TransferError(f"corrupt reply from {link.who}: not the bytes asked for")
            staged = ranges.packed(seg.view.data_ptr())
            sizes = ranges.length * ranges.count
            copy_runs(staged.dest_addresses(), ranges.dest_addresses(), sizes, link.check_deadline)
            done = True
        finally:
            if done:
                pool.release(key)
            else:  # the agent may still be copying into it
                pool.discard(key)
