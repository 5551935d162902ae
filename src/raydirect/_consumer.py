"""Consumer side: choose a transport, fetch, map failures to clear errors.

This is the one place that orchestrates transfers: transport choice and
fallback, deadlines, counters, clean-up after a producer's loss. Transports
below it only move bytes.

Which transport reads an object is ``_choice``'s answer; ``run_all`` runs
several reads at once, each writing only while its call's gate is open.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from raydirect import _channel, _payload, _plugin_transfer, _process, _ray, _wire
from raydirect._choice import (
    CROSS_NODE_ENGINE,
    SAME_NODE,
    SAME_NODE_FALLBACK,
    choose_transport,
    refused_cma,
    refused_nixl,
)
from raydirect._collector import collector_paused
from raydirect._device_targets import make_targets, on_device
from raydirect._into import copy_into, data_address, match, take_hint, writable_bytes
from raydirect._lifetime import lifetimes
from raydirect._payload import PREPARING, InlinePayload, Payload, check_usable_here
from raydirect._ranges import ByteViews, Ranges
from raydirect._split import join
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
    ProducerLostError,
    TransferError,
    TransportUnavailableError,
)
from raydirect.transports.base import ByteTransport, PeerMetadata, WriteGate, metadata_classes
from raydirect.transports.registry import AUTO, transport_class, transport_instance
from raydirect.transports.shm import sweep_dead_segments

log = logging.getLogger("raydirect")
T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


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
    payload: Payload | InlinePayload,
    deadline: float | None = None,
    forced: str | None = None,
    into: dict[int, Any] | None = None,
    device: torch.device | None = None,
    gate: WriteGate | None = None,
) -> list[Any]:
    """The tensors of ``payload`` in this process (copies, or the originals when
    this process produced them); tensor ``i`` lands in ``into[i]`` where given
    (targets already checked by ``_into.match``), the others on ``device`` where
    given (checked by ``_device_targets.target_device``). Bytes are written only while
    ``gate`` (the calling ``rd.get``'s, when it reads several refs) is open."""
    into = into or {}
    metas = payload.metas
    if isinstance(payload, InlinePayload):  # the tensors came with the value
        return on_device(_fill(list(payload.tensors), into, gate), metas, device)
    if payload.producer.process_token == _process.PROCESS_TOKEN:
        obj = _own_object(payload)
        store.count_received("local", obj.nbytes)
        lifetimes.count_read(obj)
        return on_device(_fill(list(obj.originals), into, gate), metas, device)
    name = choose_transport(payload, forced)
    if not transport_class(name).byte_transport:
        received = _receive_plugin(name, payload, deadline)
        return on_device(_fill(received, into, gate), metas, device)
    received = _with_fallback(
        payload,
        forced,
        name,
        lambda n: _receive_bytes(n, payload, deadline, forced, _on(n, payload, into, device), gate),
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
    if device.type not in _writable(transport_class(name)):
        return into  # received into the transport's own buffer, then copied over
    return {**make_targets(payload.metas, device, into), **into}


def _writable(cls: type[Any]) -> frozenset[str]:
    """The device types byte transport ``cls`` writes into: its ``devices`` and
    its ``receive_devices``."""
    return frozenset(cls.devices) | frozenset(cls.receive_devices)


def writes_into(payload: Payload) -> frozenset[str] | None:
    """The device types a ``fetch_ranges`` of ``payload`` in this process writes
    its ranges into, over the transport it would choose now (``_writable``); None
    where any device torch copies onto will do, the bytes being copied over from
    where they are (the producer is this process, or a plug-in transport returns
    its tensors). ``TransferError`` and friends as ``choose_transport`` raises."""
    if payload.producer.process_token == _process.PROCESS_TOKEN:
        return None
    cls = transport_class(choose_transport(payload, None))
    return _writable(cls) if cls.byte_transport else None


def fetch_ranges(
    payload: Payload,
    ranges: Ranges,
    deadline: float | None = None,
    forced: str | None = None,
    gate: WriteGate | None = None,
) -> None:
    """Read just ``ranges`` of ``payload``'s tensors into ``ranges.dests``. Byte
    transports that are ``ranged`` move only those bytes; the others (and
    plug-ins) read whole tensors here, then the ranges are copied out. Bytes
    are written only while ``gate`` is open."""
    if payload.producer.process_token == _process.PROCESS_TOKEN:
        obj = _own_object(payload)
        # As the agent's copies: a region's close waits for this one, and once it
        # has closed the copy is refused, never made from memory the owner reuses.
        with obj.serving(), _writing(gate):
            _copy_ranges(obj.buffers, ranges)
        store.count_received("local", ranges.nbytes)
        lifetimes.count_read(obj)
        return
    name = choose_transport(payload, forced)
    if not transport_class(name).byte_transport:
        received = _receive_plugin(name, payload, deadline)
        with _writing(gate):
            _copy_ranges([flat_bytes(as_tensor(t)) for t in received], ranges)  # type: ignore[arg-type]
        return
    _with_fallback(
        payload, forced, name, lambda n: _read_bytes(n, payload, deadline, forced, ranges, gate)
    )


def _writing(gate: WriteGate | None) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext() if gate is None else gate.writing()


def _own_object(payload: Payload) -> StoredObject:
    obj = store.get(payload.obj_id)
    if obj is None:
        raise ProducerLostError.of(payload.producer.describe(), "already freed the object")
    return obj


def _with_fallback(payload: Payload, forced: str | None, name: str, read: Callable[[str], T]) -> T:
    """``read(name)``; under ``auto``, a producer nixl fails to read is read over
    the next choice (and from then on)."""
    if name == CROSS_NODE_ENGINE and (forced or payload.transport) == AUTO:
        try:
            return read(name)
        except (TransferError, TransportUnavailableError, ImportError) as exc:
            refused_nixl.add(payload.producer)
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
    gate: WriteGate | None,
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
    _read_bytes(name, payload, deadline, forced, Ranges.of_whole(slots), gate)
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
    name: str,
    payload: Payload,
    deadline: float | None,
    forced: str | None,
    ranges: Ranges,
    gate: WriteGate | None = None,
) -> None:
    """Read ``ranges`` over byte transport ``name``, while ``gate`` is open; under
    ``auto``, a producer whose memory the kernel refuses to cross-read is read
    over ``shm``."""
    producer = payload.producer
    same_node = producer.node_id == _ray.node_id()
    comm = PeerMetadata(producer, payload.capability, deadline, same_node, gate, payload.nbytes)
    _check_writes(name, ranges)  # out here: the kernel's refusal alone means "not cma"
    try:
        try:
            with _writing(gate):
                _read(name, payload, comm, ranges)
        except TransportUnavailableError:
            if name != SAME_NODE or (forced or payload.transport) != AUTO:
                raise
            refused_cma.add(producer)
            log.info(
                "raydirect: cross-memory reads refused; using %r on this node", SAME_NODE_FALLBACK
            )
            name = SAME_NODE_FALLBACK
            _check_writes(name, ranges)
            with _writing(gate):
                _read(name, payload, comm, ranges)
    except ProducerLostError:
        if same_node:
            sweep_dead_segments(producer.pid)
        _channel.forget(producer.agent_address)
        raise
    store.count_received(name, ranges.nbytes)


def _fill(tensors: list[Any], into: dict[int, Any], gate: WriteGate | None) -> list[Any]:
    """Tensors that arrived elsewhere (the producer's own, a plug-in's), copied
    into targets while ``gate`` is open."""
    if not into:
        return tensors
    with _writing(gate):
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


def _check_writes(name: str, ranges: Ranges) -> None:
    """Refuse ranges that transport ``name`` would write itself (whole reads, or
    any read of a ``ranged`` one) where it cannot write (a read that fell back
    from the transport its caller laid the ranges out for), before it writes:
    host bytes written to a device address would corrupt or crash. The others
    read into scratch memory of their own and copy the ranges out."""
    cls = transport_class(name)
    if ranges.devices is None or not (ranges.whole or getattr(cls, "ranged", False)):
        return
    writable = _writable(cls)
    if not ranges.devices <= writable:
        raise TransportUnavailableError(
            f"{name!r} writes {'/'.join(sorted(writable))} memory, but these ranges land in "
            f"{'/'.join(sorted(ranges.devices - writable))} memory; nothing was read: read "
            "them into memory it writes, then copy them over"
        )


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
    payload: Payload | InlinePayload,
    deadline: float | None = None,
    forced: str | None = None,
    targets: dict[int, Any] | None = None,
    device: torch.device | None = None,
    gate: WriteGate | None = None,
) -> Any:
    """The value ``payload`` stands for, rebuilt in this process; into
    ``targets`` (from ``_into.match``) or onto ``device`` where given, else as an
    ``rd.set_target`` hint says (targets, or a device); bytes written only while
    ``gate`` is open."""
    check_usable_here()
    hint = take_hint(payload.obj_id)
    if targets is None and device is None and hint is not None:
        if isinstance(hint, torch.device):
            device = hint
        else:
            targets = match(payload, hint)
    tensors = fetch_tensors(payload, deadline, forced, targets, device, gate)
    with collector_paused():
        return join(payload.skeleton, tensors, payload.handles)


_payload.set_fetcher(fetch_value)


# ------------------------------------------------------------ several reads at once

_FETCH_THREADS = 8
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def fetch_pool() -> ThreadPoolExecutor:
    """The threads that run this process's concurrent reads (``run_all``)."""
    global _pool
    with _pool_lock:  # two callers at once must not make two pools
        if _pool is None:
            _pool = ThreadPoolExecutor(_FETCH_THREADS, thread_name_prefix="raydirect-fetch")
        return _pool


@dataclass
class Outcome(Generic[K, T]):
    """What ``run_all`` ended with: every job's result, or the first failure that
    is not a timeout, and the jobs that had not ended by the deadline (or timed out)."""

    results: dict[K, T]
    error: BaseException | None
    late: list[K]


def run_all(
    jobs: Mapping[K, Callable[[WriteGate], T]],
    deadline: float | None,
    gate: WriteGate | None = None,
) -> Outcome[K, T]:
    """Run every job at once on the fetch pool, each writing only while ``gate``
    (a new one if None) is open, until all end, one fails, or ``deadline``. On a
    failure or the deadline the gate closes before this returns: no job writes
    the caller's memory any more (the others stop at their next piece)."""
    gate = gate or WriteGate()
    futures = {key: fetch_pool().submit(job, gate) for key, job in jobs.items()}
    remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
    done, not_done = wait_futures(futures.values(), timeout=remaining, return_when=FIRST_EXCEPTION)
    errors = [f.exception() for f in futures.values() if f in done]
    if not not_done and not any(errors):
        return Outcome({key: f.result() for key, f in futures.items()}, None, [])
    gate.close()
    error = next((e for e in errors if e is not None and not isinstance(e, TimeoutError)), None)
    late = [key for key, f in futures.items() if f in not_done or f.exception()]
    return Outcome({}, error, late)


def _forget_after_fork() -> None:
    # A forked child has none of the pool's threads: a submit would wait for ever.
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
