"""Seals: one 8-byte word per open region or live object, in shared memory.

A seal holds ``seal_value(id, capability)`` (a region's: and its extent)
while its region or object may be read, and zero once it is closed or freed
(``Store.seal``): the free zeroes it before the memory can go. A same-node
reader (``cma``, ``cuda_ipc``) checks it before its copy and again after the
last byte has landed, as a seqlock's reader does: if it still holds then, the
free had not begun, so no byte read was memory the producer had handed to
another object. Readers may hold an object's Payload after its free (Ray
keeps a borrowed value whose owner died, and that death freed the object), and
a region is read while its owner may close it.

Seals live in slabs: files in /dev/shm, ``rd-<pid>-<start time>-seals-<n>``,
mapped by the producer, and read-only by each reader, which keeps them mapped.
A check is then a load, no system call: a read's seal, made and checked twice,
costs 1.7 µs, where it cost 10.7 as two ``process_vm_readv`` and would cost
15.7 with the slab mapped at each read (timed in one process, 20,000 reads);
and it works where cross-memory attach is refused, so CUDA IPC readers check
too. A seal is named by its slot number alone: the slab's name follows from
the producer's pid and start time, which every reader already has and checks.
Slabs are never freed while the process runs: a slot is reused by a later
object, whose value differs. They are unlinked at exit, a killed process's by
the sweep of dead processes' segments (``transports.shm``), which the ``rd-``
prefix puts them under.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from raydirect import _process

SHM_DIR = "/dev/shm"
_SLAB = 8192  # seals per slab (64 KiB)
_MAPPED = 64  # reader: slabs kept mapped, the least recently checked let go


def seal_value(obj_id: bytes, capability: bytes, extent: bytes = b"") -> int:
    """What a seal holds while its object may be read: a digest of its id,
    capability and ``extent`` (never zero), so that a reader holding another
    fails the check. A region's extent (``region_extent``) is where its tensors
    lie and how long they are: its handle travels outside Ray (JSON, HTTP), and
    a ``cma`` reader copies from the addresses and within the sizes the handle
    names, with no agent to check them, so the seal vouches for them too."""
    if not extent:  # objects: the digest as it has always been
        digest = hashlib.blake2b(obj_id + capability, digest_size=8, person=b"raydirect-seal")
    else:  # every part's length too: no bytes can move from one part to the next
        digest = hashlib.blake2b(digest_size=8, person=b"raydirect-extent")
        for part in (obj_id, capability, extent):
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
    return int.from_bytes(digest.digest(), "little") or 1


def region_extent(ptrs: bytes, nbytes: Sequence[int]) -> bytes:
    """A region's extent, as its seal covers it: the tensors' addresses as
    ``cma`` packs them (``ptrs``) and their sizes (int64, little-endian). The
    owner makes it from what it exports; a reader from what it reads by."""
    sizes = np.asarray(nbytes, dtype="<i8").tobytes()
    return len(ptrs).to_bytes(8, "little") + ptrs + sizes


def slab_path(pid: int, start_time: int, slab: int) -> str:
    return os.path.join(SHM_DIR, f"rd-{pid}-{start_time}-seals-{slab}")


class Seals:
    """This process's seals (the producer's side)."""

    def __init__(self) -> None:
        self.start()
        atexit.register(self.unlink_all)

    def start(self) -> None:
        """No seal taken, no slab made yet: at first, and in a forked child, whose
        inherited slabs map its parent's files (so they are let go, never written;
        other modules hold this very instance, so it is reset, not replaced)."""
        self._lock = threading.Lock()
        self._slabs: list[np.ndarray] = []
        self._free: list[int] = []
        self._pid, self._start_time = _process.PID, _process.START_TIME

    def take(self, value: int) -> int:
        """A slot holding ``value`` now: its number, what readers are given."""
        with self._lock:
            if not self._free:
                self._add_slab()
            slot = self._free.pop()
            slab, i = divmod(slot, _SLAB)
            self._slabs[slab][i] = value
            return slot

    def _add_slab(self) -> None:
        path = slab_path(self._pid, self._start_time, len(self._slabs))
        try:
            # O_NOFOLLOW, O_EXCL: /dev/shm is world-writable; the name must be ours.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                # Its pages now: a write to a page a full tmpfs cannot give is SIGBUS.
                os.posix_fallocate(fd, 0, 8 * _SLAB)
                words = np.frombuffer(mmap.mmap(fd, 8 * _SLAB), dtype=np.uint64)
            finally:
                os.close(fd)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"raydirect keeps each object's seal (what same-node readers check) in "
                f"{SHM_DIR}, and could not make {path} there: {exc.strerror}. Give this "
                f"process a writable {SHM_DIR} (a container's --shm-size, its mount)",
            ) from exc
        first = len(self._slabs) * _SLAB
        self._slabs.append(words)
        self._free.extend(reversed(range(first, first + _SLAB)))

    def address(self, slot: int) -> tuple[int, int, int]:
        """(its slab's address, the slab's size, the slot's address) in this process,
        for a transport whose readers read the seal through a registration of the slab."""
        with self._lock:
            words = self._slabs[slot // _SLAB]
        base = words.ctypes.data
        return base, words.nbytes, base + 8 * (slot % _SLAB)

    def release(self, slot: int) -> None:
        """Zero the slot (its object is freed from now on) and free it for reuse."""
        with self._lock:
            slab, i = divmod(slot, _SLAB)
            self._slabs[slab][i] = 0
            self._free.append(slot)

    def unlink_all(self) -> None:
        """Remove the slab files (at exit: a reader that mapped one keeps reading it)."""
        if os.getpid() != self._pid:  # a forked child's exit: the files are its parent's
            return
        for slab in range(len(self._slabs)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(slab_path(self._pid, self._start_time, slab))


seals = Seals()


class _Mapped:
    """The reader's side: other processes' slabs, mapped read-only on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slabs: OrderedDict[tuple[int, int, int], np.ndarray] = OrderedDict()

    def words(self, pid: int, start_time: int, slab: int) -> np.ndarray | None:
        """The slab ``slab`` of the process (pid, start_time); None when it has no
        such file (it exited, or never made one: no seal of its holds)."""
        key = (pid, start_time, slab)
        with self._lock:
            words = self._slabs.get(key)
            if words is not None:
                self._slabs.move_to_end(key)
                return words
        try:
            fd = os.open(slab_path(pid, start_time, slab), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size != 8 * _SLAB:
                return None
            words = np.frombuffer(mmap.mmap(fd, 8 * _SLAB, prot=mmap.PROT_READ), np.uint64)
        finally:
            os.close(fd)
        with self._lock:
            self._slabs[key] = words
            while len(self._slabs) > _MAPPED:  # unmapped once no check holds it
                self._slabs.popitem(last=False)
        return words


_mapped = _Mapped()


class Seal:
    """A reader's view of one seal of the process (pid, start_time): ``holds()``
    while it holds ``want``; ``visible`` if its slab could be mapped here (the
    process has exited, or does not share this /dev/shm, if not). Raises
    ``ValueError`` for a slot no seal can have."""

    def __init__(self, slot: object, pid: int, start_time: int, want: int) -> None:
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < 1 << 40:
            raise ValueError(f"a seal's slot is a small non-negative integer, got {slot!r}")
        slab, self._i = divmod(slot, _SLAB)
        self._slab = (pid, start_time, slab)
        self._words = _mapped.words(pid, start_time, slab)
        self.want = want

    @property
    def visible(self) -> bool:
        return self._words is not None

    @property
    def path(self) -> str:
        """Its slab's file (named in errors only: not built on every read)."""
        return slab_path(*self._slab)

    def holds(self) -> bool:
        return self._words is not None and int(self._words[self._i]) == self.want


# After ``_process`` has renamed the child (registered first, as imported first).
os.register_at_fork(after_in_child=seals.start)
