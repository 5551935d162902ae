"""Producer side: turn a value into a Payload whose tensors stay here, and serve it.

``export`` keeps the value's tensors in the store and returns the Payload that
stands for them. The ops a consumer sends about an object are served from here
(registered with the server at import): ``fetch`` (a byte transport streams or
stages the object), ``meta`` (metadata prepared in the background, waited for),
``sent`` (a one-sided read finished); a two-sided plug-in's ``send`` and
``abort`` are ``_plugin_serve``'s.
When the store frees an object, every transport that set something up for it
releases it here (``garbage_collect``).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import ray
import torch

from raydirect import _groups, _process, _ray, _runtime, _server, _wire
from raydirect._collector import collector_paused
from raydirect._lease import leases
from raydirect._lifetime import Lifetime, lifetimes
from raydirect._payload import (
    PREPARING,
    InlineValue,
    Payload,
    ProducerInfo,
    check_usable_here,
)
from raydirect._plugin_serve import abort_sends
from raydirect._ranges import ByteViews
from raydirect._server import CONTROL, DATA, Reply
from raydirect._split import SplitValue, split
from raydirect._store import StoredObject, capability_of, store
from raydirect._tensors import TensorMetas, flat_bytes, storage_keys, version_counters
from raydirect.errors import ProducerLostError, TransferError
from raydirect.transports import nixl_agent
from raydirect.transports.base import ByteTransport
from raydirect.transports.registry import (
    AUTO,
    Registration,
    check_name,
    registration,
    transport_instance,
)

# ``auto`` picks per consumer among these device types.
_AUTO_DEVICES = ("cpu", "cuda")
# Free to extract, so every object carries them: what ``auto`` may pick in the
# consumer without asking the producer (same-node reads, shared groups).
_AUTO_EXTRACTED = {"cpu": ("cma", "gloo"), "cuda": ("cuda_ipc", "nccl")}

INLINE_ENV = "RAYDIRECT_INLINE_BYTES"
DEFAULT_INLINE_BYTES = 64 << 10

log = logging.getLogger("raydirect")
_session: tuple[int, str] | None = None
_preparation_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def inline_limit() -> int:
    """Under ``auto``, values whose CPU tensors total at most this many bytes go
    inline with Ray's reply (``RAYDIRECT_INLINE_BYTES``, default 64 KiB)."""
    return int(os.environ.get(INLINE_ENV, DEFAULT_INLINE_BYTES))


def _inline(metas: TensorMetas) -> bool:
    # Below a few tens of KiB a direct fetch costs more than the bytes: a lease,
    # a round trip to the producer's agent. Ray inlines small replies (up to
    # 100 KiB) in the task's own answer, so they arrive with no extra hop.
    limit = inline_limit()
    if limit <= 0:
        return False
    return set(metas.devices) <= {"cpu"} and metas.total_bytes() <= limit


def _check_devices(transport: str, metas: TensorMetas, label: str) -> None:
    devices = set(metas.devices)
    allowed = _AUTO_DEVICES if transport == AUTO else registration(transport).devices
    for device in sorted(devices):
        if device not in allowed:
            raise ValueError(
                f"{label} returned a tensor on {device}, but tensor_transport="
                f"{transport!r} moves only {'/'.join(allowed)} memory. Move the tensor "
                f"(tensor.cpu()) or pick a transport for {device} memory."
            )
    if len(devices) > 1:
        raise ValueError(
            f"{label} returned tensors on several device types; one object's "
            "tensors must share one (return them as separate objects)"
        )


def _extracted(transport: str, tensors: list[torch.Tensor], plugin: bool) -> set[str]:
    """The byte transports whose metadata this object carries."""
    device = tensors[0].device.type
    # Group transports describe the groups this process is in: only when it is in one.
    names = {
        n
        for n in _AUTO_EXTRACTED.get(device, ())
        if n not in _groups.BACKENDS or _groups.in_live_group(n)
    }
    if transport != AUTO and not plugin:
        names.add(transport)
    return names


def _preparer() -> ThreadPoolExecutor:
    # One thread: preparations run in the order objects were made, never in
    # the producer's own method thread. Locked: two pools would break that order.
    global _preparation_pool
    with _pool_lock:
        if _preparation_pool is None:
            _preparation_pool = ThreadPoolExecutor(1, thread_name_prefix="raydirect-prepare")
        return _preparation_pool


def _extract(obj: StoredObject, name: str, background: bool, extract: Callable[[], Any]) -> Any:
    """Transport ``name``'s metadata for ``obj`` now, or ``PREPARING`` while the
    preparation thread makes it (``obj.preparing``; the agent hands it out)."""
    if not background:
        meta = extract()
        if meta:
            obj.transport_state[name] = meta  # handed back to garbage_collect
        return meta
    future = _preparer().submit(extract)
    obj.preparing[name] = future
    future.add_done_callback(functools.partial(_prepared, obj, name))
    return PREPARING


def _byte_extra(transport: Any, obj: StoredObject) -> dict[str, Any]:
    # Byte transports keep only the ``extra`` dict: the rest is in the Payload.
    extra = dict(transport.extract_tensor_transport_metadata(obj.obj_id, obj.buffers).extra)
    if transport.sealed and obj.lifetime:  # what a failed seal says
        extra["lifetime"] = obj.lifetime
    return transport.with_seal(extra, obj.seal) if transport.sealed else extra


def _prepared(obj: StoredObject, name: str, future: Future[Any]) -> None:
    try:
        meta = future.result()
    except Exception:
        log.exception("raydirect: preparing %s for %s failed", name, obj.label)
        return  # the consumer that asks gets the error from the future
    with obj.lock:
        if not obj.freed:
            obj.transport_state[name] = meta
            return
    _release_one(obj, name, meta)  # freed while it was being prepared


def _served_on_request() -> tuple[str, ...]:
    return ("nixl",) if nixl_agent.installed() else ()


def _prepare_on_request(obj: StoredObject, name: str) -> Future[Any]:
    """Start (once) preparing ``obj`` for byte transport ``name``, which a
    consumer asked for: ``auto`` objects carry no metadata for such transports."""
    transport = transport_instance(name)
    if not (transport.byte_transport and transport.extract_in_background):
        raise ValueError(f"{name!r} is not prepared on request")
    if obj.live is not None and obj.lifetime is None:  # a region: its close frees nothing
        raise ValueError(f"{name!r} does not read regions: rd.read_ranges does")
    with obj.lock:
        if obj.freed:
            raise ProducerLostError.freed_meanwhile()
        future = obj.preparing.get(name)
        if future is None:
            future = _preparer().submit(_byte_extra, transport, obj)
            obj.preparing[name] = future
            future.add_done_callback(functools.partial(_prepared, obj, name))
    return future


def _plugin(transport: str) -> Registration | None:
    """The registration of a plug-in transport; None for ``auto`` and byte transports."""
    if check_name(transport) == AUTO:
        return None
    reg = registration(transport)
    return None if reg.cls.byte_transport else reg


def export(
    value: Any,
    transport: str,
    label: str | None = None,
    inline: bool = True,
    leased: bool = True,
    lifetime: Lifetime | None = None,
    caller_lease: Callable[[bytes], ray.ObjectRef | None] | None = None,
) -> Any:
    """Keep ``value``'s tensors in this process and return the Payload standing
    for it; a value without tensors is returned unchanged, a small one under
    ``auto`` travels inline (unless ``inline`` is False). ``leased``: the Payload
    carries a lease (``put`` binds the lifetime to its own ref instead).
    ``lifetime``: no lease; freed by its reads or clock (``_lifetime``).
    ``caller_lease(obj_id)``: the lease the caller passed (``_caller_leases``),
    now standing for ``obj_id``; None where there is none, or it is void here:
    this process's own lease then."""
    check_usable_here()
    with collector_paused():  # thousands of tensors described: no collection midway
        return _export(
            value, transport, label, inline, leased and lifetime is None, lifetime, caller_lease
        )


def put(value: Any, transport: str, label: str, inline: bool = True) -> ray.ObjectRef:
    """``rd.put``: ``ray.put`` of ``value``'s Payload, with no lease. This process
    owns the put ref, and Ray never inlines a put object into a task spec (2.60
    inlines puts only in local mode), so the ref's own out-of-scope callback is
    the object's exact lifetime: no second Ray object, no pubsub."""
    payload = export(value, transport, label, inline, leased=False)
    if not isinstance(payload, Payload):
        return ray.put(payload)
    obj_id = payload.obj_id
    try:
        ref = ray.put(payload)
    except BaseException:
        store.free(obj_id)
        raise
    if not _ray.add_out_of_scope_callback(ref, lambda _id: store.free_later(obj_id)):
        store.free_later(obj_id)  # cannot happen while we hold ``ref``; stay correct anyway
    return ref


def _export(
    value: Any,
    transport: str,
    label: str | None,
    inline: bool,
    leased: bool,
    lifetime: Lifetime | None,
    caller_lease: Callable[[bytes], ray.ObjectRef | None] | None,
) -> Any:
    plugin = _plugin(transport)
    label = label or _ray.current_task_label()
    parts = split(value, only=plugin.data_type if plugin is not None else None)
    if not parts.tensors:
        return value
    if inline and transport == AUTO and _inline(parts.metas):
        return InlineValue.of(parts, label)
    _check_devices(transport, parts.metas, label)
    _forget_earlier_sessions()
    agent = _runtime.agent()
    obj = _stored(parts, transport, label)
    try:
        # Sealed before any transport sees it: a preparation in the background
        # hands the seal out too. Every object is read over one (cma or cuda_ipc).
        store.seal(obj)
        if lifetime is None:
            transport_meta = _extract_all(obj, transport, parts, plugin)
        else:
            transport_meta = _guarded(obj, transport, lifetime)
        lease = _lease_for(obj.obj_id, caller_lease) if leased else None
    except BaseException:
        store.free(obj.obj_id)
        raise
    producer = ProducerInfo(
        agent_address=agent.address,
        node_id=_ray.node_id(),
        pid=_process.PID,
        start_time=_process.START_TIME,
        process_token=_process.PROCESS_TOKEN,
        label=label,
        transports=_served_on_request(),
    )
    return Payload(
        obj_id=obj.obj_id,
        capability=obj.capability,
        skeleton=parts.skeleton,
        handles=parts.handles,
        metas=parts.metas,
        transport=transport,
        producer=producer,
        transport_meta=transport_meta,
        lease=lease,
        actor=None if plugin is None or plugin.cls.is_one_sided() else _ray.current_actor_handle(),
    )


def _lease_for(
    obj_id: bytes, caller_lease: Callable[[bytes], ray.ObjectRef | None] | None
) -> ray.ObjectRef:
    """The caller's lease where there is one, else a lease of this process's own."""
    lease = None if caller_lease is None else caller_lease(obj_id)
    return lease if lease is not None else leases.take(lambda: store.free_later(obj_id))


def _guarded(obj: StoredObject, transport: str, lifetime: Lifetime) -> dict[str, Any]:
    """Start ``obj``'s lifetime; the metadata its readers need, as a region's:
    ``cma``, ``cuda_ipc`` and ``nixl`` check the seal, ``shm`` and ``tcp`` reads
    are copied out by the agent."""
    lifetimes.start(obj, lifetime)
    if "cuda" in obj.metas.devices:
        metas = {"cuda_ipc": _byte_extra(transport_instance("cuda_ipc"), obj)}
    else:
        metas = {"cma": _byte_extra(transport_instance("cma"), obj), "shm": {"live": True}}
    if transport == "nixl":  # else prepared when a reader asks (``_prepare_on_request``)
        extract = functools.partial(_byte_extra, transport_instance("nixl"), obj)
        metas["nixl"] = _extract(obj, "nixl", True, extract)
    return metas


def _forget_earlier_sessions() -> None:
    global _session
    session = _ray.session_key()
    if session != _session:
        # Objects of an earlier Ray session can never be released by their leases.
        store.clear()
        _session = session


def _stored(parts: SplitValue, transport: str, label: str) -> StoredObject:
    obj_id, nbytes = _process.new_id(), parts.metas.total_bytes()
    obj = StoredObject(
        obj_id=obj_id,
        capability=capability_of(obj_id, nbytes),
        originals=parts.originals,
        buffers=_byte_views(parts),
        metas=parts.metas,
        versions=version_counters(parts.tensors),
        storages=storage_keys(parts.tensors),
        label=label,
        transport=transport,
        nbytes=nbytes,
    )
    store.add(obj)
    return obj


def _byte_views(parts: SplitValue) -> ByteViews:
    """The bytes each tensor sends; a non-contiguous one is packed once, now.
    Flat views are made only for transports that use them: ``cma`` needs addresses."""
    tensors = parts.tensors
    if all([t.is_contiguous() for t in tensors]):
        sources = tensors
    else:
        sources = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    addresses = np.array([t.data_ptr() for t in sources], dtype=np.int64)
    lengths = np.asarray(parts.metas.nbytes, dtype=np.int64)
    return ByteViews(addresses, lengths, lambda i: flat_bytes(sources[i]))


def _extract_all(
    obj: StoredObject, transport: str, parts: SplitValue, plugin: Registration | None
) -> dict[str, Any]:
    transport_meta: dict[str, Any] = {}
    for name in _extracted(transport, parts.tensors, plugin is not None):
        byte_transport = transport_instance(name)
        extract = functools.partial(_byte_extra, byte_transport, obj)
        extra = _extract(obj, name, byte_transport.extract_in_background, extract)
        if extra:
            transport_meta[name] = extra
    if plugin is not None:
        # Plug-ins see the value's own tensors and the object id as a string, as in Ray RDT.
        manager = transport_instance(transport)
        transport_meta[transport] = _extract(
            obj,
            transport,
            manager.extract_in_background,
            lambda: manager.extract_tensor_transport_metadata(obj.obj_id.hex(), parts.originals),
        )
    return transport_meta


# ------------------------------------------------------------ freeing


def _release_one(obj: StoredObject, name: str, meta: Any) -> None:
    """Let transport ``name`` release what it set up for ``obj`` (described by ``meta``)."""
    try:
        transport = transport_instance(name)
        if transport.byte_transport:
            transport.garbage_collect(obj.obj_id, meta, obj.buffers)
        else:
            transport.garbage_collect(obj.obj_id.hex(), meta, obj.originals)
    except Exception:
        log.exception("raydirect: %s garbage_collect failed for %s", name, obj.obj_id.hex())


def _release_state(obj: StoredObject) -> None:
    """Let every transport that set something up for ``obj`` release it, and
    abort its two-sided sends still running: freed, nobody can want them, and a
    consumer's abort that arrives after the free finds no object to abort.
    One with a lifetime is first closed to reads (``_lifetime``)."""
    lifetimes.release(obj)
    abort_sends(obj)
    for name, meta in list(obj.transport_state.items()):
        _release_one(obj, name, meta)
    obj.transport_state.clear()


# ------------------------------------------------------------ ops served


def _serve_fetch(obj: StoredObject, request: dict[str, Any], reply: Reply) -> None:
    name = str(request.get("transport", ""))
    transport = transport_instance(name)
    if not isinstance(transport, ByteTransport):
        raise TransferError(f"transport {name!r} is not served by the agent")
    obj.check_unmodified()
    obj_id, counted = obj.obj_id, obj.live is not None  # not obj: a stream holds this

    def delivered(nbytes: int) -> None:
        store.count_sent(name, nbytes)
        if counted:
            lifetimes.count_read_of(obj_id)

    with obj.serving():  # a region: its close waits until this read is off its memory
        transport.serve(obj, request, reply, delivered)


def _serve_sent(request: dict[str, Any], reply: Reply) -> None:
    """One-sided reads finished (a batch from one consumer's notice thread,
    ``_notices``): count each (all bytes, or the ranges read), check for in-place
    writes, answer when asked. A notice races Ray's free of its object, so a read
    of an object freed since counts too: its capability vouches for its size."""
    reads = request.get("reads")
    counted = sum(map(_count_read, reads)) if isinstance(reads, list) else 0
    if _wire.wants_reply(request):
        reply.send({"ok": True, "counted": counted})


def _count_read(read: Any) -> int:
    try:
        obj_hex, cap_hex, transport, nbytes, total = read
        obj_id, capability = bytes.fromhex(obj_hex), bytes.fromhex(cap_hex)
        if not (isinstance(total, int) and isinstance(nbytes, int) and 0 <= total < 1 << 63):
            raise ValueError("bad size")
    except (TypeError, ValueError):  # nothing to refuse: the batch's others still count
        log.debug("raydirect agent: a malformed read notice dropped")
        return 0
    found = store.read_of(obj_id, capability, total)
    if found is None:  # never logs a capability, nor more of an id than tells objects apart
        log.debug("raydirect agent: a read of %s reported, not made here", obj_id.hex()[:8])
        return 0
    obj, held = found
    if obj is not None:
        obj.check_unmodified()
        lifetimes.count_read(obj)
    store.count_sent(str(transport)[:32], min(nbytes, held) if nbytes >= 0 else held)
    return 1


def _serve_meta(obj: StoredObject, request: dict[str, Any], reply: Reply) -> None:
    """Metadata prepared in the background, sent once ready. No thread waits for
    it: the reply goes when the preparation ends (a consumer that gave up by
    then has closed its channel, and the reply is dropped)."""
    name = str(request.get("transport", ""))
    future = obj.preparing.get(name)
    if future is None and request.get("prepare"):
        try:
            future = _prepare_on_request(obj, name)
        except Exception as exc:
            reply.send(_wire.refusal(_wire.TRANSFER, f"{name}: {exc}"))
            return
    if future is None:
        reply.send(_wire.refusal(_wire.BAD_REQUEST, f"nothing prepared for {name}"))
        return
    future.add_done_callback(functools.partial(_send_meta, name, reply))


def _send_meta(name: str, reply: Reply, future: Future[Any]) -> None:
    """The reply to a ``meta`` request, from whichever thread ended the preparation."""
    try:
        meta = future.result()
        frames: list[bytes] = []
        reply.send({"ok": True, "meta": _wire.encode_value(meta, frames)}, *frames)
    except Exception as exc:
        error = f"preparing it for {name} failed: {type(exc).__name__}: {exc}"
        reply.send(_wire.refusal(_wire.TRANSFER, error))


store.on_free(_release_state)
_server.register(_wire.FETCH, _serve_fetch, needs_object=True, lane=DATA)
_server.register(_wire.META, _serve_meta, needs_object=True, lane=DATA)
_server.register(_wire.SENT, _serve_sent, needs_object=False, lane=CONTROL)


def _forget_after_fork() -> None:
    # The preparation thread did not survive the fork; the parent's objects are
    # the parent's (the store forgets them, unfreed).
    global _session, _preparation_pool, _pool_lock
    _session, _preparation_pool = None, None
    _pool_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
