"""Consumer side: choose a transport, fetch, map failures to clear errors.

This is the one place that orchestrates transfers: transport choice and
fallback, deadlines, counters, clean-up after a producer's loss. Transports
below it only move bytes.

``auto``, per pair of processes (by Ray node id; the choice is logged at debug level):
  same process      -> the stored tensors themselves, no copy
  same node, cpu    -> ``cma`` (one copy straight from the producer's memory);
                       ``shm`` where the kernel refuses cross-memory reads
  same node, cuda   -> ``cuda_ipc``
  other node        -> ``nixl`` when both processes have NIXL installed (the
                       producer registers the object's memory when first asked),
                       else a collective group both are in (``gloo`` for cpu,
                       ``nccl`` for cuda), else ``tcp``; a producer whose nixl
                       read fails is read over the next choice from then on.
                       Under encryption (this process's, or a producer whose
                       stream port encrypts) ``tcp`` always: nixl and the
                       groups move bytes in clear, and naming one logs a
                       warning once
A declared same-node transport read from another node, and a two-sided
transport read outside the producer's group (the driver, a non-member), fall
back to ``tcp``, logged once per process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from raydirect import _channel, _payload, _plugin_transfer, _process, _ray, _tls, _wire
from raydirect._collector import collector_paused
from raydirect._into import (
    copy_into,
    data_address,
    make_targets,
    match,
    on_device,
    take_hint,
    writable_bytes,
)
from raydirect._payload import PREPARING, Payload, ProducerInfo, join
from raydirect._ranges import ByteViews, Ranges
from raydirect._store import StoredObject, store
from raydirect._tensors import (
    TensorMetas,
    allocate_bytes,
    arena_layout,
    as_tensor,
    flat_bytes,
    tensors_from_arena,
)
from raydirect.errors import (
    GroupError,
    ProducerLostError,
    TransferError,
    TransportUnavailableError,
)
from raydirect.transports import nixl
from raydirect.transports.base import ByteTransport, PeerMetadata, metadata_classes
from raydirect.transports.registry import AUTO, check_name, transport_class, transport_instance
from raydirect.transports.shm import sweep_dead_segments

log = logging.getLogger("raydirect")
T = TypeVar("T")

_SAME_NODE = "cma"
_SAME_NODE_FALLBACK = "shm"
_SAME_NODE_CUDA = "cuda_ipc"
_CROSS_NODE = "tcp"
_CROSS_NODE_ENGINE = "nixl"
_CLEAR_ACROSS_NODES = frozenset({"nixl", "gloo", "nccl"})  # what raydirect does not encrypt
_REFUSALS_KEPT = 1024


class _Refusals:
    """Producer processes a transport failed to read, so ``auto`` reads them over
    the next choice. Keyed by process token: a restarted producer is a new
    process and gets a fresh try. Bounded: the oldest are forgotten."""

    def __init__(self) -> None:
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, producer: ProducerInfo) -> None:
        with self._lock:
            self._seen[producer.process_token] = None
            while len(self._seen) > _REFUSALS_KEPT:
                self._seen.popitem(last=False)

    def __contains__(self, producer: ProducerInfo) -> bool:
        with self._lock:
            return producer.process_token in self._seen


_refused_cma = _Refusals()  # producers whose memory the kernel refuses to cross-read
_refused_nixl = _Refusals()  # ... and those nixl failed to read
_logged_fallbacks: set[Any] = set()
_lock = threading.Lock()


def choose_transport(payload: Payload, forced: str | None) -> str:
    """The transport this process uses to read ``payload`` (not for same-process reads)."""
    wanted = check_name(forced or payload.transport)
    producer = payload.producer
    same_node = producer.node_id == _ray.node_id()
    if wanted == AUTO:
        choice = _choose_auto(payload, same_node)
        log.debug("raydirect: auto chose %r for an object of %s", choice, producer.describe())
        return choice
    if transport_class(wanted).same_node_only and not same_node:
        _log_fallback_once(wanted, "reaches only the producer's node; objects from other nodes")
        return _CROSS_NODE
    if wanted in _CLEAR_ACROSS_NODES and not same_node and _encrypting(payload):
        _warn_clear_once(wanted)
    transport = transport_instance(wanted)
    if not transport.byte_transport:
        if wanted not in payload.transport_meta:
            raise TransportUnavailableError(
                f"the object of {producer.describe()} was made for {payload.transport!r}, so "
                f"plug-in transport {wanted!r} cannot read it; do not force the transport"
            )
        if not transport.actor_has_tensor_transport(_ray.current_actor_handle()):
            if forced:
                raise TransportUnavailableError(
                    f"tensor_transport={forced!r} was forced, but the transport says this "
                    "process cannot use it (actor_has_tensor_transport returned False)"
                )
            _log_fallback_once(wanted, "is not available in this process; objects made for it")
            return _CROSS_NODE
        return wanted
    if not transport.reachable(payload.transport_meta.get(wanted, {})):
        if forced and wanted not in payload.transport_meta:
            raise TransportUnavailableError(
                f"tensor_transport={forced!r} was forced, but the object of "
                f"{producer.describe()} was made for {payload.transport!r}, not for {forced!r}: "
                "do not force the transport, or make the object with this one"
            )
        if forced:
            raise GroupError(
                f"tensor_transport={forced!r} was forced, but this process shares no live "
                f"{forced} group with the producer {producer.describe()}: add both to a group "
                "with rd.create_collective_group, or do not force the transport"
            )
        _log_fallback_once(wanted, "needs the producer's group; processes outside it")
        return _CROSS_NODE
    return wanted


def _encrypting(payload: Payload) -> bool:
    """Does this read fall under encryption: this process encrypts, or the
    producer's stream port does (its address carries a TLS pin)?"""
    return _tls.encryption_wanted() or _wire.TLS_MARK in payload.producer.agent_address


def _warn_clear_once(name: str) -> None:
    with _lock:
        first = ("clear", name) not in _logged_fallbacks
        _logged_fallbacks.add(("clear", name))
    if first:
        log.warning(
            "raydirect: %r was named under encryption (RAY_USE_TLS or RAYDIRECT_ENCRYPT): "
            "it moves tensor bytes across nodes in clear; 'auto' would use the encrypted "
            "tcp stream",
            name,
        )


def _choose_auto(payload: Payload, same_node: bool) -> str:
    producer = payload.producer
    cuda = "cuda" in payload.metas.devices
    if same_node:
        if cuda:
            return _SAME_NODE_CUDA
        if producer in _refused_cma:
            return _SAME_NODE_FALLBACK
        return _SAME_NODE
    if _encrypting(payload):  # never a transport that moves bytes in clear across machines
        return _CROSS_NODE
    if (
        _CROSS_NODE_ENGINE in producer.transports
        and producer not in _refused_nixl
        and nixl.installed()
    ):
        return _CROSS_NODE_ENGINE
    backend = "nccl" if cuda else "gloo"  # a group both are in, if any
    groups = payload.transport_meta.get(backend)
    if groups is not None and transport_instance(backend).reachable(groups):
        return backend
    return _CROSS_NODE


def _log_fallback_once(wanted: str, why: str) -> None:
    with _lock:
        first = wanted not in _logged_fallbacks
        _logged_fallbacks.add(wanted)
    if first:  # once per process, not per transfer
        log.warning("raydirect: %r %s read over %r", wanted, why, _CROSS_NODE)


def _arena_device(name: str, payload: Payload) -> str:
    devices = set(payload.metas.devices)
    if devices <= {"cpu"}:
        return "cpu"
    supported = transport_class(name).devices
    if not devices <= set(supported):
        raise TransportUnavailableError(
            f"the object holds {'/'.join(sorted(devices))} tensors, which {name!r} cannot move; "
            "read it from a member of the producer's nccl group"
        )
    return "cuda"


def _allocatable(device: str, name: str) -> str:
    """``device``, once this process can allocate there (before a byte moves)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise TransportUnavailableError(
            f"the object holds CUDA tensors and this process sees no GPU, so {name!r} has "
            "nowhere to put them: give the reading actor one (num_gpus=...), or read into "
            "host memory with rd.get(ref, device='cpu')"
        )
    return device


def fetch_tensors(
    payload: Payload,
    deadline: float | None = None,
    forced: str | None = None,
    into: dict[int, Any] | None = None,
    device: torch.device | None = None,
) -> list[Any]:
    """The tensors of ``payload`` in this process (copies, or the originals when
    this process produced them); tensor ``i`` lands in ``into[i]`` where given
    (targets already checked by ``_into.match``), the others on ``device`` where
    given (checked by ``_into.target_device``)."""
    into = into or {}
    metas = payload.metas
    if payload.producer.process_token == _process.PROCESS_TOKEN:
        obj = _own_object(payload)
        store.count_received("local", obj.nbytes)
        return on_device(_fill(list(obj.originals), into), metas, device)
    name = choose_transport(payload, forced)
    if not transport_class(name).byte_transport:
        return on_device(_fill(_receive_plugin(name, payload, deadline), into), metas, device)
    received = _with_fallback(
        payload,
        forced,
        name,
        lambda n: _receive_bytes(n, payload, deadline, forced, _on(n, payload, into, device)),
    )
    return on_device(received, metas, device)


def _on(
    name: str, payload: Payload, into: dict[int, Any], device: torch.device | None
) -> dict[int, Any]:
    """``into`` and, where transport ``name`` writes onto ``device`` itself though its
    own buffer would be elsewhere (``cuda_ipc`` copying a producer's CUDA tensors
    straight into host memory), new tensors there: one copy, no staging."""
    if device is None or device.type == _arena_device(name, payload):
        return into
    cls = transport_class(name)
    if device.type not in (cls.receive_devices or cls.devices):
        return into  # received into the transport's own buffer, then copied over
    return {**make_targets(payload.metas, device, into), **into}


def fetch_ranges(
    payload: Payload, ranges: Ranges, deadline: float | None = None, forced: str | None = None
) -> None:
    """Read just ``ranges`` of ``payload``'s tensors into ``ranges.dests``. Byte
    transports that are ``ranged`` move only those bytes; the others (and
    plug-ins) read whole tensors here, then the ranges are copied out."""
    if payload.producer.process_token == _process.PROCESS_TOKEN:
        _copy_ranges(_own_object(payload).buffers, ranges)
        store.count_received("local", ranges.nbytes)
        return
    name = choose_transport(payload, forced)
    if not transport_class(name).byte_transport:
        received = _receive_plugin(name, payload, deadline)
        _copy_ranges([flat_bytes(as_tensor(t)) for t in received], ranges)  # type: ignore[arg-type]
        return
    _with_fallback(
        payload, forced, name, lambda n: _read_bytes(n, payload, deadline, forced, ranges)
    )


def _own_object(payload: Payload) -> StoredObject:
    obj = store.get(payload.obj_id)
    if obj is None:
        raise ProducerLostError.of(payload.producer.describe(), "already freed the object")
    return obj


def _with_fallback(payload: Payload, forced: str | None, name: str, read: Callable[[str], T]) -> T:
    """``read(name)``; under ``auto``, a producer nixl fails to read is read over
    the next choice (and from then on)."""
    if name == _CROSS_NODE_ENGINE and (forced or payload.transport) == AUTO:
        try:
            return read(name)
        except (TransferError, TransportUnavailableError, ImportError) as exc:
            _refused_nixl.add(payload.producer)
            log.warning(
                "raydirect: nixl could not read from %s (%s); reading it over the next choice",
                payload.producer.describe(),
                exc,
            )
            name = choose_transport(payload, forced)
    return read(name)


def _receive_bytes(
    name: str,
    payload: Payload,
    deadline: float | None,
    forced: str | None,
    into: dict[int, Any],
) -> list[Any]:
    metas = payload.metas
    with collector_paused():  # thousands of slots laid out: no collection midway
        if len(into) == len(metas):  # every tensor has a target
            missing: Sequence[int] = ()
        else:
            missing = [i for i in range(len(metas)) if i not in into] if into else range(len(metas))
        landing = metas.select(missing) if into else metas  # in the arena
        offsets, total = arena_layout(landing)
        device = _allocatable(_arena_device(name, payload), name) if missing else "cpu"
        arena = allocate_bytes(total, device) if missing else None
        slots = _slots(metas, missing, offsets, arena, into)
    _read_bytes(name, payload, deadline, forced, Ranges.of_whole(slots))
    if arena is None:
        return list(map(into.__getitem__, range(len(metas))))
    with collector_paused():
        received = tensors_from_arena(arena, landing, offsets)
    if not into:
        return received
    out: list[Any] = [into.get(i) for i in range(len(metas))]
    for i, tensor in zip(missing, received, strict=True):
        out[i] = tensor
    return out


def _slots(
    metas: TensorMetas,
    missing: Sequence[int],
    offsets: list[int],
    arena: torch.Tensor | None,
    into: dict[int, Any],
) -> ByteViews:
    """Where each tensor lands: its slot of ``arena``, or its target in ``into``."""
    lengths = np.asarray(metas.nbytes, dtype=np.int64)
    addresses = np.zeros(len(metas), dtype=np.int64)
    if arena is not None:
        addresses[np.asarray(missing, dtype=np.int64)] = arena.data_ptr() + np.asarray(
            offsets, dtype=np.int64
        )
    # Slot starts by tensor index: the offsets themselves when the arena holds all.
    starts: Any = dict(zip(missing, offsets, strict=True)) if into else offsets
    if into:  # data_address written out for tensors: no function call per target
        known = getattr(into, "addresses", None)  # MatchedTargets: read when described
        addresses[np.fromiter(into, dtype=np.int64, count=len(into))] = (
            known
            if known is not None
            else [
                t.data_ptr() if type(t) is torch.Tensor else data_address(t) for t in into.values()
            ]
        )

    def view(i: int) -> torch.Tensor:
        if i in into:
            return writable_bytes(into[i])
        start = starts[i]
        return arena[start : start + metas.nbytes[i]]  # type: ignore[index]

    return ByteViews(addresses, lengths, view)


def _read_bytes(
    name: str, payload: Payload, deadline: float | None, forced: str | None, ranges: Ranges
) -> None:
    """Read ``ranges`` over byte transport ``name``; under ``auto``, a producer
    whose memory the kernel refuses to cross-read is read over ``shm``."""
    producer = payload.producer
    same_node = producer.node_id == _ray.node_id()
    comm = PeerMetadata(producer, payload.capability, deadline, same_node)
    try:
        try:
            _read(name, payload, comm, ranges)
        except TransportUnavailableError:
            if name != _SAME_NODE or (forced or payload.transport) != AUTO:
                raise
            _refused_cma.add(producer)
            log.info(
                "raydirect: cross-memory reads refused; using %r on this node", _SAME_NODE_FALLBACK
            )
            name = _SAME_NODE_FALLBACK
            _read(name, payload, comm, ranges)
    except ProducerLostError:
        if same_node:
            sweep_dead_segments(producer.pid)
        raise
    store.count_received(name, ranges.nbytes)


def _fill(tensors: list[Any], into: dict[int, Any]) -> list[Any]:
    """Tensors that arrived elsewhere (the producer's own, a plug-in's), copied into targets."""
    for i, target in into.items():
        tensors[i] = copy_into(target, tensors[i])
    return tensors


def _read(name: str, payload: Payload, comm: PeerMetadata, ranges: Ranges) -> None:
    extra = _transport_meta(payload, name, comm.deadline) or {}
    transport = transport_instance(name)
    assert isinstance(transport, ByteTransport)
    if ranges.whole or transport.ranged:
        transport.read(payload.obj_id, extra, comm, ranges)
        return
    # Whole tensors into scratch memory, then the ranges out of it.
    metas = payload.metas
    offsets, total = arena_layout(metas)
    scratch = allocate_bytes(total, _arena_device(name, payload))
    whole = [scratch[off : off + m.nbytes] for off, m in zip(offsets, metas, strict=True)]
    transport.read(payload.obj_id, extra, comm, Ranges.of_whole(whole))
    _copy_ranges(whole, ranges)


def _copy_ranges(sources: Sequence[Any], ranges: Ranges) -> None:
    """Copy ``ranges`` out of ``sources`` (flat uint8 tensors, one per tensor) locally."""
    for row, dest in enumerate(ranges.dests):
        view = ranges.strided_view(sources[int(ranges.index[row])], row)
        dest.view(view.shape).copy_(view)


def _transport_meta(payload: Payload, name: str, deadline: float | None) -> Any:
    """What transport ``name`` extracted for ``payload``, asking the producer's
    agent (and waiting) when it is still being prepared in the background."""
    meta = payload.transport_meta.get(name)
    on_request = name not in payload.transport_meta and _prepared_on_request(name)
    if meta != PREPARING and not on_request:
        return meta
    who = payload.producer.describe()
    header: dict[str, Any] = {
        "op": _wire.META,
        "obj": payload.obj_id.hex(),
        "cap": payload.capability.hex(),
        "transport": name,
        "prepare": on_request,
        "timeout": None if deadline is None else max(0.0, deadline - time.monotonic()),
    }
    answer, frames = _channel.ask(payload.producer.agent_address, header, deadline, who)
    try:
        meta = _wire.decode_value(answer["meta"], [f.bytes for f in frames], metadata_classes())
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise TransferError(f"corrupt metadata from {who}: {exc}") from exc
    payload.transport_meta[name] = meta  # once per rebuilt Payload
    return meta


def _prepared_on_request(name: str) -> bool:
    cls = transport_class(name)
    return cls.byte_transport and cls.extract_in_background


def _receive_plugin(name: str, payload: Payload, deadline: float | None) -> list[Any]:
    meta = _transport_meta(payload, name, deadline)
    return _plugin_transfer.receive(name, transport_instance(name), payload, meta, deadline)


def fetch_value(
    payload: Payload,
    deadline: float | None = None,
    forced: str | None = None,
    targets: dict[int, Any] | None = None,
    device: torch.device | None = None,
) -> Any:
    """The value ``payload`` stands for, rebuilt in this process; into
    ``targets`` (from ``_into.match``) or onto ``device`` where given, else as an
    ``rd.set_target`` hint says (targets, or a device)."""
    hint = take_hint(payload.obj_id)
    if targets is None and device is None and hint is not None:
        if isinstance(hint, torch.device):
            device = hint
        else:
            targets = match(payload, hint)
    tensors = fetch_tensors(payload, deadline, forced, targets, device)
    with collector_paused():
        return join(payload.skeleton, tensors, payload.handles)


_payload.set_fetcher(fetch_value)
