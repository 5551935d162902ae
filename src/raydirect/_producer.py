"""Producer side: turn a value into a Payload whose tensors stay here."""

from __future__ import annotations

import functools
import logging
import os
import secrets
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from raydirect import _agent, _groups, _ray
from raydirect._lease import leases
from raydirect._payload import PREPARING, Payload, ProducerInfo, split
from raydirect._store import StoredObject, store
from raydirect._tensors import flat_bytes
from raydirect.transports.registry import (
    AUTO,
    check_name,
    registration,
    release_one,
    transport_instance,
)

# ``auto`` picks per consumer among these; cma's metadata (addresses) is free to
# extract, so every object carries it.
_AUTO_DEVICES = ("cpu", "cuda")
# Free to extract, so every object carries them: what ``auto`` may pick in the
# consumer without asking the producer (same-node reads, shared groups).
_AUTO_EXTRACTED = {"cpu": ("cma", "gloo"), "cuda": ("cuda_ipc", "nccl")}

INLINE_ENV = "RAYDIRECT_INLINE_BYTES"
DEFAULT_INLINE_BYTES = 64 << 10

_session: tuple[int, str] | None = None
_preparation_pool: ThreadPoolExecutor | None = None
log = logging.getLogger("raydirect")


def inline_limit() -> int:
    """Under ``auto``, values whose CPU tensors total at most this many bytes go
    inline with Ray's reply (``RAYDIRECT_INLINE_BYTES``, default 64 KiB)."""
    return int(os.environ.get(INLINE_ENV, DEFAULT_INLINE_BYTES))


def _inline(metas: list[Any]) -> bool:
    # Below a few tens of KiB a direct fetch costs more than the bytes: a lease,
    # a round trip to the producer's agent. Ray inlines small replies (up to
    # 100 KiB) in the task's own answer, so they arrive with no extra hop.
    limit = inline_limit()
    if limit <= 0:
        return False
    return all(m.device == "cpu" for m in metas) and sum(m.nbytes for m in metas) <= limit


def _check_devices(transport: str, tensors: list[torch.Tensor], label: str) -> None:
    devices = _AUTO_DEVICES if transport == AUTO else registration(transport).devices
    for t in tensors:
        if t.device.type not in devices:
            raise ValueError(
                f"{label} returned a tensor on {t.device}, but tensor_transport="
                f"{transport!r} moves only {'/'.join(devices)} memory. Move the tensor "
                f"(tensor.cpu()) or pick a transport for {t.device.type} memory."
            )


def _extracted(transport: str, tensors: list[torch.Tensor], plugin: bool) -> set[str]:
    """The byte transports whose metadata this object carries."""
    device = tensors[0].device.type
    names = {n for n in _AUTO_EXTRACTED.get(device, ()) if _extracts_cheaply(n)}
    if transport != AUTO and not plugin:
        names.add(transport)
    return names


def _extracts_cheaply(name: str) -> bool:
    # Group transports describe the groups this process is in: only when it is in one.
    if name not in _groups.BACKENDS:
        return True
    return any(not g.broken for g in _groups.local_groups(name).values())


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


def _extra(transport: Any, obj_id: bytes, buffers: list[torch.Tensor]) -> dict[str, Any]:
    # Byte transports keep only the ``extra`` dict: the rest is in the Payload.
    return dict(transport.extract_tensor_transport_metadata(obj_id, buffers).extra)


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
    release_one(obj, name, meta)  # freed while it was being prepared


@functools.cache
def _served_on_request() -> tuple[str, ...]:
    from raydirect.transports import nixl

    return ("nixl",) if nixl.installed() else ()


def prepare_on_request(obj: StoredObject, name: str) -> Future[Any]:
    """Start (once) preparing ``obj`` for byte transport ``name``, which a
    consumer asked for: ``auto`` objects carry no metadata for such transports."""
    transport = transport_instance(name)
    if not (transport.byte_transport and transport.extract_in_background):
        raise ValueError(f"{name!r} is not prepared on request")
    with obj.lock:
        if obj.freed:
            raise ValueError("the object was freed")
        future = obj.preparing.get(name)
        if future is None:
            future = _preparer().submit(_extra, transport, obj.obj_id, obj.buffers)
            obj.preparing[name] = future
            future.add_done_callback(functools.partial(_prepared, obj, name))
    return future


def _preparer() -> ThreadPoolExecutor:
    # One thread: preparations run in the order objects were made, never in
    # the producer's own method thread.
    global _preparation_pool
    if _preparation_pool is None:
        _preparation_pool = ThreadPoolExecutor(1, thread_name_prefix="raydirect-prepare")
    return _preparation_pool


def export(value: Any, transport: str, label: str | None = None) -> Any:
    """Keep ``value``'s tensors in this process and return the Payload standing
    for it; a value without tensors is returned unchanged."""
    global _session
    plugin = None if check_name(transport) == AUTO else registration(transport)
    if plugin is not None and plugin.cls.byte_transport:
        plugin = None
    label = label or _ray.current_task_label()
    parts = split(value, only=plugin.data_type if plugin is not None else None)
    if not parts.tensors or (transport == AUTO and _inline(parts.metas)):
        return value
    _check_devices(transport, parts.tensors, label)
    if len({t.device.type for t in parts.tensors}) > 1:
        raise ValueError(
            f"{label} returned tensors on several device types; one object's "
            "tensors must share one (return them as separate objects)"
        )
    session = _ray.session_key()
    if session != _session:
        # Objects of an earlier Ray session can never be released by their leases.
        store.clear()
        _session = session
    agent = _agent.agent()
    obj_id = secrets.token_bytes(16)
    capability = secrets.token_bytes(16)
    buffers = [flat_bytes(t) for t in parts.tensors]
    obj = StoredObject(
        obj_id=obj_id,
        capability=capability,
        originals=parts.originals,
        buffers=buffers,
        metas=parts.metas,
        versions=[t._version for t in parts.tensors],
        label=label,
        transport=transport,
        nbytes=sum(m.nbytes for m in parts.metas),
    )
    store.add(obj)
    transport_meta: dict[str, Any] = {}
    try:
        for name in _extracted(transport, parts.tensors, plugin is not None):
            byte_transport = transport_instance(name)
            extra = _extract(
                obj,
                name,
                byte_transport.extract_in_background,
                functools.partial(_extra, byte_transport, obj_id, buffers),
            )
            if extra:
                transport_meta[name] = extra
        if plugin is not None:
            # Plug-ins see the value's own tensors and the object id as a string, as in Ray RDT.
            plugin_transport = transport_instance(transport)
            transport_meta[transport] = _extract(
                obj,
                transport,
                plugin_transport.extract_in_background,
                lambda: plugin_transport.extract_tensor_transport_metadata(
                    obj_id.hex(), parts.originals
                ),
            )
        lease = leases.take(lambda: store.free_later(obj_id))
    except BaseException:
        store.free(obj_id)
        raise
    producer = ProducerInfo(
        agent_address=agent.address,
        node_id=_ray.node_id(),
        pid=_agent.PID,
        start_time=_agent.START_TIME,
        process_token=_agent.PROCESS_TOKEN,
        label=label,
        transports=_served_on_request(),
    )
    return Payload(
        obj_id=obj_id,
        capability=capability,
        skeleton=parts.skeleton,
        handles=parts.handles,
        metas=parts.metas,
        transport=transport,
        producer=producer,
        transport_meta=transport_meta,
        lease=lease,
    )
