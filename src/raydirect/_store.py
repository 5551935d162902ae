"""The per-process store of primary copies, its statistics, and tensor liveness.

A producer keeps each exported object here until Ray's reference counting says
no reference is left anywhere (the lease callback). Freeing runs on a reaper
thread: the lease callback arrives on a Ray-internal thread and must not block
it with transport clean-up or large deallocations.

Long-lived regions (``_regions``) are kept here too, apart from objects: no
lease frees them, their owner closes them. The agent finds either by id.

The store knows no transport and no metrics: whoever cares registers a
callback. The producer layer registers what releases transport state when an
object is freed (``on_free``); the metrics exporter registers what starts it on
the first object or transfer (``on_first_use``).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import queue
import secrets
import threading
import time
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from raydirect import _process
from raydirect._ranges import ByteViews
from raydirect._region_seals import seal_value, seals
from raydirect._tensors import UNTRACKED, TensorMetas, storage_key
from raydirect.errors import ProducerLostError

log = logging.getLogger("raydirect")

_KEY = secrets.token_bytes(32)  # this process's: capabilities are keyed hashes
_WHYS_KEPT = 4096  # why recent objects were freed early (``free_later(why=)``)


def capability_of(obj_id: bytes, nbytes: int) -> bytes:
    """The 128-bit capability of object ``obj_id`` of ``nbytes`` bytes: a keyed
    BLAKE2b hash, so this process can check a capability (and the size it
    vouches for) long after the object is freed, with nothing remembered.
    A consumer reports a one-sided read after it ends, and Ray may have freed
    the object by then (its last ref can go as soon as the read returns)."""
    return hashlib.blake2b(obj_id + nbytes.to_bytes(8, "little"), key=_KEY, digest_size=16).digest()


@dataclass(frozen=True)
class LocalStats:
    """What this process holds and has moved. Returned by ``rd.local_stats()``."""

    num_objects: int
    """Objects this process holds as producer copies."""
    num_bytes: int
    """Tensor bytes held in those objects."""
    objects_sent: dict[str, int]
    """Transfers served to other processes, by transport."""
    bytes_sent: dict[str, int]
    objects_received: dict[str, int]
    """Objects fetched from other processes (or this one, as ``local``), by transport."""
    bytes_received: dict[str, int]
    objects_held: dict[str, int] = field(default_factory=dict)
    """Objects held (``num_objects``), by the transport they were exported with
    (``auto`` unless the method or ``put`` named one)."""
    bytes_held: dict[str, int] = field(default_factory=dict)
    """Tensor bytes held (``num_bytes``), by the transport they were exported with."""
    encryption: str = "none"
    """How this process's agent encrypts the bytes it serves over ``tcp``: ``none``,
    ``tls`` (TLS 1.3, user space) or ``ktls`` (kernel TLS); ``none`` until it starts."""
    num_regions: int = 0
    """Regions this process has exported and not closed (``rd.export_region``)."""
    region_bytes: int = 0
    """Tensor bytes those regions expose (the owner's own memory: nothing is copied)."""


class Serving:
    """The reads of a region that its owner's agent serves now (copying or sending
    from the owner's memory: ``shm``, ``tcp``). Closing the region waits for them,
    so that once ``close`` returns no agent thread touches that memory again."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._count = 0
        self.closed = False

    @contextmanager
    def read(self) -> Iterator[None]:
        """Hold the region open while serving one read; ``ProducerLostError`` once closed."""
        with self._cond:
            if self.closed:
                raise ProducerLostError.freed_meanwhile()
            self._count += 1
        try:
            yield
        finally:
            with self._cond:
                self._count -= 1
                self._cond.notify_all()

    def close(self, timeout: float | None) -> bool:
        """No read starts from now on; True once none is being served (False at ``timeout``)."""
        with self._cond:
            self.closed = True
            return self._cond.wait_for(lambda: self._count == 0, timeout)


@dataclass(slots=True)
class StoredObject:
    obj_id: bytes
    capability: bytes
    originals: list[Any]  # what the value held: returned as-is to the producer itself
    buffers: ByteViews  # flat uint8 bytes to send, one per tensor (made on first use)
    metas: TensorMetas
    versions: list[int]  # tensors' version counters when exported
    storages: list[int]  # the memory each tensor lies in (``storage_keys``)
    label: str
    transport: str
    nbytes: int
    transport_state: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    mutation_warned: bool = False
    # Transport metadata still being prepared in the background, by transport name.
    preparing: dict[str, Future[Any]] = field(default_factory=dict)
    freed: bool = False  # set under ``lock`` before its transport state is released
    # Its seal's slot (``Store.seal``), released when it is freed or closed.
    seal: int | None = None
    # Its opt-in lifetime as written (``reads=1, ttl=30``): what a failed seal says.
    lifetime: str | None = None
    # A region's (``_regions``): its bytes change, and closing waits for the reads
    # served from it; None for an object (its bytes are fixed once exported).
    live: Serving | None = None

    def serving(self) -> contextlib.AbstractContextManager[None]:
        """Around a read the agent serves from this object's memory."""
        return nullcontext() if self.live is None else self.live.read()

    def check_unmodified(self) -> None:
        """Warn (once) if a tensor was written in place after it was exported
        (inference tensors keep no version counter: their writes go unseen)."""
        if self.mutation_warned:
            return
        for original, version in zip(self.originals, self.versions, strict=True):
            if version == UNTRACKED or not isinstance(original, torch.Tensor):
                continue
            if original._version != version:
                self.mutation_warned = True
                warnings.warn(
                    f"a tensor returned by {self.label} was modified in place after it was "
                    "returned and before a consumer received it; the consumer may see the new "
                    "or a torn value. Call rd.wait_tensor_freed(tensor) before writing to a "
                    "tensor you have returned, or return a copy.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return


class Store:
    def __init__(self) -> None:
        self.encryption = "none"  # set by the agent runtime when the agent starts
        self._objects: dict[bytes, StoredObject] = {}
        self._regions: dict[bytes, StoredObject] = {}
        self._lock = threading.Condition()
        # storage key -> objects holding tensors in that memory (``storage_keys``)
        self._holders: Counter[int] = Counter()
        self._nbytes = 0
        self._held: Counter[str] = Counter()
        self._held_bytes: Counter[str] = Counter()
        self._sent: Counter[str] = Counter()
        self._sent_bytes: Counter[str] = Counter()
        self._received: Counter[str] = Counter()
        self._received_bytes: Counter[str] = Counter()
        self._free_queue: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._whys: OrderedDict[bytes, str] = OrderedDict()
        self._reaper: threading.Thread | None = None
        self._free_hooks: list[Callable[[StoredObject], None]] = []
        self._first_use_hooks: list[Callable[[], bool]] = []

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's objects are the parent's (their leases,
        segments and registrations too), so they are dropped unfreed; counters
        start again; the reaper thread did not survive."""
        _process.keep_from_parent(self._objects)
        _process.keep_from_parent(self._regions)
        self._objects = {}
        self._regions = {}
        self._lock = threading.Condition()
        self._holders.clear()
        self._nbytes = 0
        for counter in (self._held, self._held_bytes, self._sent, self._sent_bytes):
            counter.clear()
        self._received.clear()
        self._received_bytes.clear()
        self._free_queue = queue.SimpleQueue()
        self._whys = OrderedDict()
        self._reaper = None

    def on_free(self, hook: Callable[[StoredObject], None]) -> None:
        """Call ``hook(obj)`` when ``obj`` is freed, before ``wait_tensor_freed``
        waiters wake (on the reaper thread; exceptions are logged)."""
        self._free_hooks.append(hook)

    def on_first_use(self, hook: Callable[[], bool]) -> None:
        """Call ``hook()`` on objects and transfers until it returns True (it
        starts something once this process is ready for it)."""
        with self._lock:
            self._first_use_hooks.append(hook)

    def _used(self) -> None:
        if not self._first_use_hooks:
            return
        with self._lock:
            pending = list(self._first_use_hooks)
        done = [hook for hook in pending if hook()]
        if done:
            with self._lock:
                self._first_use_hooks = [h for h in self._first_use_hooks if h not in done]

    # -- producer side
    def add(self, obj: StoredObject) -> None:
        with self._lock:
            self._objects[obj.obj_id] = obj
            self._nbytes += obj.nbytes
            self._held[obj.transport] += 1
            self._held_bytes[obj.transport] += obj.nbytes
            self._holders.update(k for k in obj.storages if k)
        self._used()

    def get(self, obj_id: bytes) -> StoredObject | None:
        """The object, or open region, of id ``obj_id`` held here."""
        with self._lock:
            found = self._objects.get(obj_id)
            return found if found is not None else self._regions.get(obj_id)

    # -- regions: their owner adds and closes them (``_regions``)
    def add_region(self, region: StoredObject) -> None:
        with self._lock:
            self._regions[region.obj_id] = region
        self._used()

    def close_region(self, obj_id: bytes) -> StoredObject | None:
        """Stop serving region ``obj_id``: from now on the agent answers "lost" to
        every request naming it, and its seal fails every ``cma`` read. Returns it
        (None if it was not open)."""
        with self._lock:
            region = self._regions.pop(obj_id, None)
        if region is not None:
            with region.lock:
                region.freed = True
            self._unseal(region)
        return region

    # -- seals: what same-node readers check, as a seqlock's reader does (``_region_seals``)
    def seal(self, obj: StoredObject, extent: bytes = b"") -> int:
        """Give ``obj`` a seal holding ``seal_value(id, capability, extent)`` until it
        is freed or closed; returns its slot, for the metadata of the transports that
        check it (``ByteTransport.sealed``). Every object read over such a transport
        has one, not only regions and objects with a lifetime: a reader may hold an
        object's Payload after its free (Ray keeps a borrowed value whose owner
        died, and that death freed the object), and the producer's memory is then
        another object's. ``extent``: a region's (``region_extent``), whose handle
        travels outside Ray; b"" for an object, sealed before its metadata is
        extracted and read by the Payload Ray carries to its refs' holders."""
        obj.seal = seals.take(seal_value(obj.obj_id, obj.capability, extent))
        return obj.seal

    @staticmethod
    def _unseal(obj: StoredObject) -> None:
        if obj.seal is not None:
            seals.release(obj.seal)
            obj.seal = None

    def release(self, region: StoredObject) -> None:
        """Let every transport release what it set up for a closed region."""
        for hook in self._free_hooks:
            try:
                hook(region)
            except Exception:
                log.exception("raydirect: releasing region %s failed", region.label)

    def free_later(self, obj_id: bytes, why: str | None = None) -> None:
        """Queue ``obj_id`` for freeing; safe from any thread, never blocks.
        ``why``: it is freed while refs to it may remain (an opt-in lifetime
        ended); a late reader's refusal says so (``why_freed``)."""
        if why is not None:
            with self._lock:
                self._whys[obj_id] = why
                while len(self._whys) > _WHYS_KEPT:
                    self._whys.popitem(last=False)
        self._free_queue.put(obj_id)
        if self._reaper is None:
            with self._lock:
                if self._reaper is None:
                    self._reaper = threading.Thread(
                        target=self._reap, name="raydirect-reaper", daemon=True
                    )
                    self._reaper.start()

    def _reap(self) -> None:
        while True:
            obj_id = self._free_queue.get()
            try:
                self.free(obj_id)
            except Exception:  # a failing transport clean-up must not stop freeing
                log.exception("raydirect: freeing object %s failed", obj_id.hex())

    def free(self, obj_id: bytes) -> None:
        with self._lock:
            obj = self._objects.pop(obj_id, None)
            if obj is None:
                return
            self._nbytes -= obj.nbytes
            self._held[obj.transport] -= 1
            self._held_bytes[obj.transport] -= obj.nbytes
        with obj.lock:  # a preparation finishing from now on releases its own state
            obj.freed = True
            # Each preparation's future holds the object in its done-callback: a
            # cycle that would keep the tensors until Python's cyclic collector ran.
            obj.preparing.clear()
        self._unseal(obj)  # first: no cross-memory read succeeds from now on
        # Release transport state (a pooled segment) before waking waiters, so a
        # producer that re-exports at once finds the segment back in its pool.
        for hook in self._free_hooks:
            try:
                hook(obj)
            except Exception:
                log.exception("raydirect: releasing object %s failed", obj_id.hex()[:8])
        with self._lock:
            keys = [k for k in obj.storages if k]
            self._holders.subtract(keys)
            for key in [k for k in keys if self._holders[k] <= 0]:
                self._holders.pop(key, None)
            self._lock.notify_all()

    def why_freed(self, obj_id: bytes) -> str | None:
        """Why ``obj_id`` was freed while refs to it remained, if it was (lately)."""
        with self._lock:
            return self._whys.get(obj_id)

    def read_of(
        self, obj_id: bytes, capability: bytes, nbytes: int
    ) -> tuple[StoredObject | None, int] | None:
        """For a read a consumer reports of an object of ``nbytes`` bytes: (the
        object, if still held; its bytes), when ``capability`` is the one this
        process made for it, held or freed however long ago; else None."""
        obj = self.get(obj_id)
        if obj is not None:
            return (obj, obj.nbytes) if hmac.compare_digest(obj.capability, capability) else None
        if hmac.compare_digest(capability_of(obj_id, nbytes), capability):
            return None, nbytes
        return None

    def clear(self) -> None:
        """Drop every object (their leases belong to a Ray session that ended)."""
        with self._lock:
            ids = list(self._objects)
        for obj_id in ids:
            self.free(obj_id)

    def holds(self, tensor: Any) -> bool:
        """Does a live object hold ``tensor``'s memory (it, a view of it, or
        another tensor of the same storage)?"""
        key = storage_key(tensor)
        with self._lock:
            return bool(key) and self._holders.get(key, 0) > 0

    def wait_any_freed(self, tensors: list[Any], timeout: float | None) -> int:
        """The index of one of ``tensors`` whose memory no live object holds,
        waiting for one up to ``timeout`` seconds (``TimeoutError`` past it)."""
        keys = [storage_key(t) for t in tensors]
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                for i, key in enumerate(keys):
                    if self._holders.get(key, 0) <= 0:
                        return i
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"all {len(tensors)} tensors still held after {timeout}s")
                self._lock.wait(remaining)

    def wait_tensor_freed(self, tensor: Any, timeout: float | None) -> None:
        key = storage_key(tensor)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while key and self._holders.get(key, 0) > 0:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"tensor still held by {self._holders[key]} raydirect object(s) "
                        f"after {timeout}s: a ref to an object containing it (or a view of "
                        "its memory) is still alive somewhere (in a consumer, a pending task, "
                        "or a variable). Drop those refs, or copy the tensor instead of "
                        "writing it in place."
                    )
                self._lock.wait(remaining)

    # -- counters
    def count_sent(self, transport: str, nbytes: int) -> None:
        with self._lock:
            self._sent[transport] += 1
            self._sent_bytes[transport] += nbytes
        self._used()

    def count_received(self, transport: str, nbytes: int) -> None:
        with self._lock:
            self._received[transport] += 1
            self._received_bytes[transport] += nbytes
        self._used()

    def stats(self) -> LocalStats:
        with self._lock:
            return LocalStats(
                num_objects=len(self._objects),
                num_bytes=self._nbytes,
                objects_sent=dict(self._sent),
                bytes_sent=dict(self._sent_bytes),
                objects_received=dict(self._received),
                bytes_received=dict(self._received_bytes),
                objects_held={k: v for k, v in self._held.items() if v},
                bytes_held={k: v for k, v in self._held_bytes.items() if self._held[k]},
                encryption=self.encryption,
                num_regions=len(self._regions),
                region_bytes=sum(r.nbytes for r in self._regions.values()),
            )


store = Store()


def _new_key() -> None:
    # A forked child is another process: its capabilities are not its parent's.
    global _KEY
    _KEY = secrets.token_bytes(32)


os.register_at_fork(after_in_child=store.forget_after_fork)
os.register_at_fork(after_in_child=_new_key)
