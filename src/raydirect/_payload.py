"""The Payload Ray stores for a direct object, and the inline value that
carries a small one's tensors with it (a value is taken apart by ``_split``).

Unpickling a Payload in another process is what performs the fetch: Ray calls
``_rebuild`` wherever it deserializes the object (``ray.get``, task arguments),
and ``_rebuild`` hands the Payload to the fetcher the consumer layer registered
(``set_fetcher``): this module knows values, not transports.
"""

from __future__ import annotations

import functools
import itertools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch

from raydirect import _process, _ray
from raydirect._split import SplitValue, join, state_dict_keys
from raydirect._tensors import (
    TensorMetas,
    arena_layout,
    as_tensor,
    describe_all,
    flat_bytes,
    tensors_from_arena,
)
from raydirect.errors import RaydirectError

# Stands in ``Payload.transport_meta`` for metadata the producer still prepares
# in the background: the consumer asks the producer's agent for it.
PREPARING = "raydirect:preparing"


@dataclass(frozen=True, slots=True)
class ProducerInfo:
    """Where an object's tensors live and how to reach them."""

    agent_address: str  # tcp://ip:port of the producer's agent
    node_id: str  # Ray node id
    pid: int
    start_time: int  # process start time in clock ticks: tells a reused pid apart
    process_token: bytes  # random per process: "same process" test
    label: str  # Class.method / task name, for messages
    # Optional transports this process can serve on request (``auto`` across nodes).
    transports: tuple[str, ...] = ()

    def describe(self) -> str:
        host = self.agent_address.removeprefix("tcp://").rsplit(":", 1)[0]
        return f"{self.label} (pid {self.pid} on {host})"


@dataclass(slots=True)
class Payload:
    """The small picklable stand-in Ray stores for a direct object's ref."""

    obj_id: bytes
    capability: bytes
    # The value without its tensors; a state dict's keys once the Payload is rebuilt.
    skeleton: bytes | tuple[str, ...]
    handles: list[Any]
    metas: TensorMetas
    transport: str
    producer: ProducerInfo
    transport_meta: dict[str, Any] = field(default_factory=dict)
    lease: Any = None  # ObjectRef owned by the producer; its lifetime is the object's
    # The producer's actor handle, for two-sided plug-ins' get_communicator_metadata.
    actor: Any = None

    @property
    def nbytes(self) -> int:
        return self.metas.total_bytes()

    def __reduce__(self):
        return (
            _rebuild,
            (
                self.obj_id,
                self.capability,
                self.skeleton,
                self.handles,
                self.metas.pack(),
                self.transport,
                self.producer,
                self.transport_meta,
                self.lease,
                self.actor,
            ),
        )


class _Deferred(threading.local):
    active: bool = False
    tensor_transport: str | None = None


deferred = _Deferred()


@dataclass(slots=True)
class PendingFetch:
    """Returned by a rebuild under ``rd.get``: the fetch starts once every ref is resolved."""

    payload: Payload | InlinePayload


_fetcher: Callable[[Payload | InlinePayload], Any] | None = None


def set_fetcher(fetch: Callable[[Payload | InlinePayload], Any]) -> None:
    """Register what turns a Payload into its value in this process (the consumer
    layer does, when it is imported; ``import raydirect`` imports it)."""
    global _fetcher
    _fetcher = fetch


def check_usable_here() -> None:
    """``RaydirectError`` at once in a process forked from one connected to Ray
    (where Ray, and so raydirect, cannot work: a read would hang)."""
    parent = _ray.forked_from()
    if parent is not None:
        raise RaydirectError(
            f"this process was forked from pid {parent}, which was connected to Ray: Ray and "
            "raydirect cannot be used in a forked child. Start child processes with the "
            "'spawn' method (multiprocessing.get_context('spawn'), or "
            "DataLoader(multiprocessing_context='spawn')), or make the call in the parent"
        )


def get_deferred(refs: list[ray.ObjectRef], timeout: float | None = None) -> list[Any]:
    """``ray.get`` of ``refs`` with each direct object left as a ``PendingFetch``:
    nothing is fetched yet, so the caller can check targets and start all fetches at once."""
    check_usable_here()
    deferred.active = True
    try:
        return ray.get(refs, timeout=timeout)
    finally:
        deferred.active = False


def _rebuild(*state: Any) -> Any:
    payload = Payload(*state)
    payload.metas = TensorMetas.unpack(payload.metas)  # type: ignore[arg-type]
    # A state dict's keys, decoded once for every use (into= matching, join).
    payload.skeleton = state_dict_keys(payload.skeleton) or payload.skeleton
    if deferred.active:
        return PendingFetch(payload)
    if _fetcher is None:  # only if raydirect._payload was loaded without its package
        raise RuntimeError("raydirect's consumer layer is not loaded: import raydirect")
    return _fetcher(payload)


# ---------------------------------------------------------------- inline values
#
# A small value travels inside Ray's own reply (no lease, no agent round trip),
# pickled whole. A ref passed back to its producer must still yield the very
# tensors the producer holds, not copies: each tensor gets a key while it
# lives, and a rebuild in the same process swaps the originals in. One key per
# live tensor, however often it is returned: a server returning the same
# tensor a hundred thousand times keeps one entry, and a tensor's entries go
# when it does (a weak reference's callback).

_inline_by_key: dict[int, weakref.ref[Any]] = {}
_inline_by_id: dict[int, tuple[int, weakref.ref[Any]]] = {}  # id(original) -> key, ref
_inline_keys = itertools.count(1)


def _inline_key(original: Any) -> int:
    """``original``'s key (0: it cannot be weakly referenced; the producer gets a copy)."""
    entry = _inline_by_id.get(id(original))
    if entry is not None and entry[1]() is original:
        return entry[0]
    key = next(_inline_keys)
    try:
        ref = weakref.ref(original, functools.partial(_forget_inline, id(original), key))
    except TypeError:
        return 0
    # Plain dict operations, no lock: the callback may run inside a collection
    # that starts while this very thread is here.
    _inline_by_key[key] = ref
    _inline_by_id[id(original)] = (key, ref)
    return key


def _forget_inline(ident: int, key: int, _ref: Any) -> None:
    _inline_by_key.pop(key, None)
    entry = _inline_by_id.get(ident)
    if entry is not None and entry[0] == key:
        _inline_by_id.pop(ident, None)


def inline_entries() -> int:
    """Live tensors this process has returned inline (bounded by the live tensors)."""
    return len(_inline_by_key)


@dataclass(slots=True)
class InlineValue:
    """A small value whose tensors travel with it (the ``auto`` transport inlines),
    in one buffer (``_packed``)."""

    skeleton: bytes
    originals: list[Any]
    handles: list[Any]
    keys: list[int]
    label: str  # who made it, for messages
    tensors: list[Any]
    metas: TensorMetas
    # Names it for ``rd.set_target``, as a direct object's id does.
    obj_id: bytes = field(default_factory=_process.new_id)

    @classmethod
    def of(cls, parts: SplitValue, label: str) -> InlineValue:
        keys = [_inline_key(original) for original in parts.originals]
        return cls(
            parts.skeleton, parts.originals, parts.handles, keys, label, parts.tensors, parts.metas
        )

    def __reduce__(self):
        packed = (self.metas.pack(), _packed(self.tensors, self.metas))
        state = (
            _process.PROCESS_TOKEN,
            self.obj_id,
            self.label,
            self.skeleton,
            self.handles,
            self.keys,
            packed,
        )
        return (_rebuild_inline, state)


def _packed(tensors: list[Any], metas: TensorMetas) -> bytes:
    """Every tensor's bytes in one buffer, laid out as a receive arena. Pickled
    one by one, torch tensors cost 116 us to pickle and 140 us to unpickle for
    64 KiB here (torch saves each storage as a file); one buffer 21 us."""
    if len(tensors) == 1:  # most values: the tensor's own bytes are the arena
        return flat_bytes(tensors[0]).numpy().tobytes()
    offsets, total = arena_layout(metas)
    arena = torch.empty(total, dtype=torch.uint8)
    for tensor, offset, nbytes in zip(tensors, offsets, metas.nbytes, strict=True):
        if nbytes:
            arena[offset : offset + nbytes].copy_(flat_bytes(tensor))
    return arena.numpy().tobytes()


def _unpacked(packed: tuple[bytes, bytes]) -> tuple[list[Any], TensorMetas]:
    metas = TensorMetas.unpack(packed[0])
    offsets, total = arena_layout(metas)
    sent = len(packed[1])
    if sent != (metas.nbytes[0] if len(metas) == 1 else total):  # one tensor: unpadded
        raise RaydirectError(f"a corrupt inline value: {sent} bytes for {total}")
    arena = torch.empty(total, dtype=torch.uint8)  # ordinary memory: the caller's to keep
    if sent:
        arena.numpy()[:sent] = np.frombuffer(packed[1], dtype=np.uint8)
    return tensors_from_arena(arena, metas, offsets), metas


class _Made:
    """Who made an inline value, as a ``ProducerInfo`` says it in messages."""

    __slots__ = ("label",)

    def __init__(self, label: str) -> None:
        self.label = label

    def describe(self) -> str:
        return self.label


@dataclass(slots=True)
class InlinePayload:
    """An inlined value rebuilt where a read still chooses where its tensors land
    (``rd.get(into=..., device=...)``, ``rd.set_target``): they came with it, and
    are copied into the caller's tensors as a fetched object's would be read."""

    obj_id: bytes
    skeleton: bytes
    handles: list[Any]
    tensors: list[Any]
    producer: _Made
    _metas: TensorMetas | None = None

    @property
    def metas(self) -> TensorMetas:
        if self._metas is None:
            views = [as_tensor(t) for t in self.tensors]  # what split found: never None
            self._metas = describe_all(self.tensors, views)  # type: ignore[arg-type]
        return self._metas


def _rebuild_inline(
    token: bytes,
    obj_id: bytes,
    label: str,
    skeleton: bytes,
    handles: list[Any],
    keys: list[int],
    packed: tuple[bytes, bytes],
) -> Any:
    tensors, metas = _unpacked(packed)
    own = token == _process.PROCESS_TOKEN
    if own:
        tensors = [_inline_original(k, t) for k, t in zip(keys, tensors, strict=True)]
    # In its own process, the originals, whatever they are: described again if asked.
    payload = InlinePayload(
        obj_id, skeleton, handles, tensors, _Made(label), None if own else metas
    )
    if deferred.active:
        return PendingFetch(payload)
    if _fetcher is None:
        return join(skeleton, tensors, handles)
    return _fetcher(payload)  # where an rd.set_target hint says, if any


def _inline_original(key: int, received: Any) -> Any:
    ref = _inline_by_key.get(key) if key else None
    original = ref() if ref is not None else None
    return received if original is None else original
