"""``cuda_ipc``: same node, CUDA memory, through CUDA IPC handles.

The producer exports an IPC handle for each tensor's storage (PyTorch's
``_share_cuda_``); the consumer opens the handle and copies device-to-device
into its own receive buffer, so the producer can free its tensor as soon as the
object is gone. One copy, no host round trip.

PyTorch's own cross-process reference count is switched off on both sides:
it expects one release per export, but an object is exported once and read by
any number of consumers (or none), which would leave the producer's memory
held forever or freed early. raydirect already keeps the producer's tensor
alive until the object's last reference is gone, and no read outlives its
reference, so the producer releases its count at export and consumers name a
counter that does not exist (PyTorch skips a missing one without a word).

Consumer: opening a handle (``cudaIpcOpenMemHandle``, the event, the wait) is
most of a small read's cost: about 1.5-2 ms per read on an H200 (docs/gpu.md).
So each producer storage is opened once per object, not once per tensor nor
per read, and kept open in ``OpenedStorages`` while the object may still be
read here: the copies of a read are then only ``copy_`` calls and one
synchronize. What bounds the cache is its size and idle time (a producer
found dead drops its entries at once). An entry may outlive its object: a
reader may hold a ref after the producer freed the object (Ray keeps a
borrowed value whose owner died, and that death freed it), and the producer's
caching allocator then hands the memory to other tensors. So each read checks
the object's seal (``_region_seals``, as ``cma`` does) before its copies and
after they end: such a read raises ``ProducerLostError``, never returns
another tensor's bytes.

A process that has not used CUDA yet must initialise it before opening a
handle (``torch.cuda.init``, as PyTorch's own ``rebuild_cuda_tensor`` does):
without it PyTorch's caching allocator segfaults in ``getIpcDevPtr``. Seen on
an H200 in a ``num_gpus=0`` actor reading with ``device="cpu"``.

Written with the same contract as the CPU byte transports; tested where a GPU
is present (the tests skip with a reason elsewhere); the cache and the CUDA
checks are tested on the CPU with a stand-in opener (tests/test_cuda_ipc.py).
"""

from __future__ import annotations

import base64
import collections
import os
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from raydirect._ranges import Ranges
from raydirect.errors import TransferError, TransportUnavailableError
from raydirect.transports.base import (
    ByteTransport,
    PeerMetadata,
    ReadSeal,
    TensorTransportMetadata,
)


def _encode(value: Any) -> Any:
    return {"b64": base64.b64encode(value).decode()} if isinstance(value, bytes) else value


def _decode(value: Any) -> Any:
    return base64.b64decode(value["b64"]) if isinstance(value, dict) else value


# See the module's docstring: the consumer's release of an opened storage finds
# no such counter and does nothing.
_NO_COUNTER = b"/raydirect-no-cuda-ipc-counter"
# _share_cuda_'s tuple: (device, handle, size, offset, counter, counter offset, event, sync)
_DEVICE, _HANDLE, _STORAGE_OFFSET, _SHARE_COUNTER = 0, 1, 3, 4

# What bounds the consumer's open storages (see the module's docstring): the
# objects of a weight-sync loop or a pipeline stay open while they are read
# again; older ones close, oldest first.
MAX_OPEN_OBJECTS = 64
MAX_IDLE_S = 30.0

StorageKey = tuple[Any, ...]  # (device, handle, storage offset): one producer storage
Opener = Callable[[list[Any]], Any]  # a decoded share -> an opened storage


def storage_key(share: Sequence[Any]) -> StorageKey:
    """The producer storage a decoded ``_share_cuda_`` tuple names: its device, the
    IPC handle of its allocation and its offset in that allocation. Views of one
    storage export the same key (their own offsets travel beside it)."""
    return (share[_DEVICE], share[_HANDLE], share[_STORAGE_OFFSET])


class OpenedStorages:
    """The producer storages this process has opened, per object read.

    ``storages(producer, obj_id, shares)`` returns one opened storage per share,
    opening each distinct storage once (``opener``) and keeping it for later reads
    of the same object. Entries go, oldest first, beyond ``max_objects`` objects or
    after ``max_idle_s`` seconds unread (checked at each call), and all of one
    producer's with ``forget_producer`` (it died). Thread-safe; the opener runs
    outside the lock only for objects no other thread is opening (one lock per
    object would buy nothing: reads of one object are rare to overlap)."""

    def __init__(
        self,
        opener: Opener,
        max_objects: int = MAX_OPEN_OBJECTS,
        max_idle_s: float = MAX_IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._opener = opener
        self._max_objects = max_objects
        self._max_idle_s = max_idle_s
        self._clock = clock
        self._lock = threading.Lock()
        # (producer, obj_id) -> (last use, storage key -> opened storage), oldest first
        self._objects: collections.OrderedDict[
            tuple[Hashable, bytes], tuple[float, dict[StorageKey, Any]]
        ] = collections.OrderedDict()

    def storages(self, producer: Hashable, obj_id: bytes, shares: Sequence[list[Any]]) -> list:
        """One opened storage per share of object ``obj_id`` of ``producer``."""
        now = self._clock()
        key = (producer, obj_id)
        with self._lock:
            entry = self._objects.pop(key, None)
            opened = entry[1] if entry is not None else {}
            self._objects[key] = (now, opened)  # most recent last
            self._expire(now)
        out = []
        for share in shares:
            skey = storage_key(share)
            storage = opened.get(skey)
            if storage is None:
                storage = opened[skey] = self._opener(share)
            out.append(storage)
        return out

    def _expire(self, now: float) -> None:
        while self._objects:
            key, (used, _) = next(iter(self._objects.items()))
            if len(self._objects) <= self._max_objects and now - used <= self._max_idle_s:
                break
            del self._objects[key]  # the storages close when the last copy using them ends

    def forget(self, producer: Hashable, obj_id: bytes) -> None:
        with self._lock:
            self._objects.pop((producer, obj_id), None)

    def forget_producer(self, producer: Hashable) -> None:
        """Close every storage of ``producer`` (it died: its memory is gone)."""
        with self._lock:
            for key in [k for k in self._objects if k[0] == producer]:
                del self._objects[key]

    def counts(self) -> tuple[int, int]:
        """(objects, storages) open."""
        with self._lock:
            return len(self._objects), sum(len(o) for _, o in self._objects.values())


def ensure_cuda(device: int, who: str) -> None:
    """Make this process ready to open ``who``'s handles of its ``cuda:device``
    memory: CUDA initialised (a process that never used CUDA segfaults in
    PyTorch's ``getIpcDevPtr`` otherwise), and that device visible here. Raises
    ``TransportUnavailableError`` naming the fix where it cannot be."""
    if not torch.cuda.is_available():
        raise TransportUnavailableError(
            f"this process sees no CUDA device, so it cannot open {who}'s CUDA IPC "
            "handles: give the reading actor a GPU (num_gpus=...), or have the producer "
            "return CPU tensors"
        )
    try:
        torch.cuda.init()  # what torch.multiprocessing's rebuild_cuda_tensor does first
    except Exception as exc:  # noqa: BLE001 (CUDA's own errors are of several types)
        raise TransportUnavailableError(
            f"CUDA failed to start in this process ({type(exc).__name__}: {exc}), so it "
            f"cannot open {who}'s CUDA IPC handles: give the reading actor a GPU "
            "(num_gpus=...), or have the producer return CPU tensors"
        ) from exc
    count = torch.cuda.device_count()
    if not 0 <= device < count:
        raise TransportUnavailableError(
            f"{who}'s tensors are on its cuda:{device}, but this process sees {count} CUDA "
            "device(s): the two processes number the node's GPUs differently "
            "(CUDA_VISIBLE_DEVICES). Give both the same visible devices, or have the "
            "producer return CPU tensors"
        )


def open_shared(share: list[Any]) -> Any:
    """Open one producer storage (a decoded share) in this process: PyTorch's
    ``_new_shared_cuda``, with the cross-process counter switched off (the
    module's docstring). Waits, on the current stream, for the event the producer
    recorded at export."""
    share = list(share)
    share[_SHARE_COUNTER] = _NO_COUNTER
    with torch.cuda.device(int(share[_DEVICE])):
        return torch.UntypedStorage._new_shared_cuda(*share)


opened = OpenedStorages(open_shared)


def copy_from_storages(storages: Sequence[Any], handles: Sequence[dict], targets: Sequence) -> bool:
    """Issue one copy per tensor from its opened storage into its target; True if
    any copy runs on a GPU stream (the caller synchronizes once, after all)."""
    on_gpu = False
    for storage, handle, target in zip(storages, handles, targets, strict=True):
        source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
            storage, int(handle["offset"]), (int(handle["nbytes"]),), (1,)
        )
        # Onto a GPU asynchronously; into host memory (device=) a synchronous copy.
        target.copy_(source, non_blocking=target.is_cuda)
        on_gpu = on_gpu or target.is_cuda
    return on_gpu


class CudaIpcTransport(ByteTransport):
    name = "cuda_ipc"
    one_sided = True
    devices = ("cuda",)
    receive_devices = ("cuda", "cpu")  # a device-to-host copy straight into host memory
    same_node_only = True
    notify_sent = True
    sealed = True

    def extract_tensor_transport_metadata(
        self, obj_id: Any, tensors: list[Any]
    ) -> TensorTransportMetadata:
        handles = []
        shared_by: dict[int, list[Any]] = {}  # one export per storage, however many views
        for t in tensors:
            storage = t.untyped_storage()
            # (device, handle, size, offset, ref counter handle, ...): all picklable.
            shared = shared_by.get(storage.data_ptr()) if t.numel() else None
            if shared is None:
                shared = [_encode(v) for v in storage._share_cuda_()]
                if shared[_HANDLE] is not None:  # an empty storage has no handle, no counter
                    torch.UntypedStorage._release_ipc_counter_cuda(
                        _decode(shared[_SHARE_COUNTER]), shared[_SHARE_COUNTER + 1]
                    )
                if t.numel():
                    shared_by[storage.data_ptr()] = shared
            handles.append(
                {
                    "share": shared,
                    "offset": t.storage_offset() * t.element_size(),
                    "nbytes": t.numel() * t.element_size(),
                }
            )
        return TensorTransportMetadata(
            tensor_meta=[], tensor_device="cuda", extra={"handles": handles}
        )

    def receive(
        self, obj_id: bytes, extra: dict[str, Any], link: PeerMetadata, ranges: Ranges
    ) -> None:
        targets = ranges.dests  # whole tensors: this transport is not ``ranged``
        picked = [
            (handle, target)
            for handle, target in zip(extra["handles"], targets, strict=True)
            if handle["nbytes"]
        ]
        if not picked:
            return
        handles = [h for h, _ in picked]
        shares = [[_decode(v) for v in h["share"]] for h in handles]
        ensure_cuda(int(shares[0][_DEVICE]), link.who)
        link.check_deadline()
        producer = link.producer.process_token
        # An opened storage stays readable after its producer died (the driver keeps
        # the mapping): the pid check, a poll of a pidfd, is what notices the death.
        if not link.producer_alive():
            opened.forget_producer(producer)
            link.check_alive()
        seal = ReadSeal.of(obj_id, extra, link)
        if seal is not None:  # nothing read once the object is freed ...
            seal.check()
        try:
            storages = opened.storages(producer, obj_id, shares)
            on_gpu = copy_from_storages(storages, handles, [t for _, t in picked])
            if on_gpu:
                torch.cuda.current_stream().synchronize()
        except RuntimeError as exc:  # CUDA's own error: say whose memory it was
            opened.forget(producer, obj_id)
            if not link.producer_alive():
                opened.forget_producer(producer)
            link.check_alive("died before its CUDA memory was read")
            raise TransferError(
                f"could not read {link.who}'s CUDA memory over CUDA IPC: {exc}"
            ) from exc
        if seal is not None:  # ... nor while it was being freed (the copies have ended)
            seal.check()


def _forget_after_fork() -> None:
    # CUDA does not survive a fork; neither do the parent's opened storages.
    global opened
    opened = OpenedStorages(open_shared)


os.register_at_fork(after_in_child=_forget_after_fork)
