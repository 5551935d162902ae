"""Long-lived regions, the reader's side: ranged reads and notices.

``read_ranges`` turns a handle into the Payload the consumer layer reads (one
with no lease, made once per handle) and its rows into ``Ranges`` landing in
the caller's memory, then reads them with ``_consumer.fetch_ranges``, the path
a weight subscriber's sharded loads take: the same transport choice (``cma`` on
the owner's node, ``shm`` where the kernel refuses it, ``tcp`` from elsewhere,
or what the caller forces), fallback, deadlines, gate, error mapping and
counters. Nothing here moves bytes. No Ray call and no lease: a read is one
``process_vm_readv`` batch on the owner's node, one request elsewhere.

One-sided plug-ins read whole tensors (their interface has no ranges): the
owner's agent extracts them for this one read from the tensors as they are now
(``region_extract``), the ranges are copied out of what arrived, and the read
is released (``region_release``), which fails if the region closed meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from raydirect import _channel, _process, _ray, _wire
from raydirect._consumer import fetch_ranges
from raydirect._payload import Payload, check_usable_here
from raydirect._ranges import ByteViews, Ranges
from raydirect._region_handle import RegionHandle
from raydirect._region_rows import checked_rows
from raydirect._split import not_dense
from raydirect._store import store
from raydirect._target_checks import LAZY_VIEW, UNWRITABLE, unwritable
from raydirect._timeouts import checked_timeout
from raydirect.errors import FetchTimeoutError, ProducerLostError, TransferError
from raydirect.transports.base import WriteGate, metadata_classes
from raydirect.transports.registry import AUTO, check_name, transport_class

# Rows per request to the owner's agent: a request stays well under its 1 MiB cap.
_ROWS_PER_READ = 8192
NOTICE_MAX_BYTES = 64 << 10
_CACHED_PAYLOADS = 64
_BYTE_TRANSPORTS = frozenset({AUTO, "cma", "shm", "tcp"})
_ASYNC_THREADS = 4

_payloads: OrderedDict[RegionHandle, Payload] = OrderedDict()
_payloads_lock = threading.Lock()
_async_executor: ThreadPoolExecutor | None = None
_async_lock = threading.Lock()


def read_ranges(
    handle: Any,
    rows: Any,
    *,
    into: Any,
    timeout: float | None = None,
    tensor_transport: str | None = None,
    notify: Any = None,
) -> int:
    """Read byte ranges of a region straight into your memory; returns the bytes read.

    ``handle``: a ``Region.handle()``, or its ``to_dict()``/``to_json()``.
    ``rows``: an ``(n, 5)`` table of ints (a numpy array or lists), each row
    ``(tensor, offset, length, dest, dest_offset)``: ``length`` bytes from byte
    ``offset`` of the region's tensor ``tensor`` (its index; ``handle.index(name)``
    for a dict's) into byte ``dest_offset`` of ``into[dest]``. ``into``: one
    destination or a list of them: contiguous CPU tensors (any dtype; offsets
    count bytes), numpy arrays, or writable buffers. Rows that continue one
    another on both sides are merged; everything is checked before a byte
    moves (``ValueError``/``TypeError`` naming the row or destination).

    ``timeout`` bounds the whole call (``rd.FetchTimeoutError``, a
    ``TimeoutError``); ``tensor_transport`` forces one (``cma``, ``shm``, ``tcp``,
    a one-sided plug-in). ``notify``: a JSON-serialisable value (not None, at
    most 64 KiB encoded) sent to the owner once every byte has landed
    (``Region.notices()``, ``on_notice``); the call returns once the owner's
    agent has it.

    ``rd.ProducerLostError`` naming the region once its owner closed it or died:
    no read returns bytes read after the owner began closing it. After any
    error the destinations may hold some of the bytes, and nothing of this
    call writes them any more."""
    return _read(handle, rows, into, timeout, tensor_transport, notify, None)


async def read_ranges_async(
    handle: Any,
    rows: Any,
    *,
    into: Any,
    timeout: float | None = None,
    tensor_transport: str | None = None,
    notify: Any = None,
) -> int:
    """``rd.read_ranges`` for coroutines: the read runs on a worker thread and
    the event loop keeps running. Cancelled (a timeout around it, say), the read
    stops, and nothing of it writes ``into`` once the cancellation is raised."""
    loop = asyncio.get_running_loop()
    gate = WriteGate()
    call = functools.partial(_read, handle, rows, into, timeout, tensor_transport, notify, gate)
    try:
        return await loop.run_in_executor(_async_pool(), call)
    except asyncio.CancelledError:
        await loop.run_in_executor(None, gate.close)
        raise


def notify_region(handle: Any, message: Any, *, timeout: float | None = None) -> None:
    """Send ``message`` (JSON-serialisable, not None, at most 64 KiB encoded) to
    the owner of the region ``handle`` names (``Region.notices()``, its
    ``on_notice``), without reading: for instance "I will not read blocks X" so
    its owner frees them. Returns once the owner's agent has it.
    ``rd.ProducerLostError`` if the region is closed or its owner gone;
    ``rd.FetchTimeoutError`` past ``timeout``."""
    timeout = checked_timeout(timeout)
    check_usable_here()
    region = RegionHandle.of(handle)
    encoded = _notice(message)
    deadline = None if timeout is None else time.monotonic() + timeout
    with _mapped_errors(region, timeout, "notifying its owner", writes=False):
        _ask(_payload_of(region), {"op": _wire.REGION_NOTICE, "message": encoded}, deadline)


def _read(
    handle: Any,
    rows: Any,
    into: Any,
    timeout: float | None,
    forced: str | None,
    notify: Any,
    gate: WriteGate | None,
) -> int:
    timeout = checked_timeout(timeout)
    check_usable_here()
    region = RegionHandle.of(handle)
    dests = _destinations(into)
    table = checked_rows(rows, region.nbytes, [d.nbytes for d in dests], [d.address for d in dests])
    message = None if notify is None else _notice(notify)
    name = _checked_transport(forced, region)
    payload = _payload_of(region)
    deadline = None if timeout is None else time.monotonic() + timeout
    with _mapped_errors(region, timeout, "reading it"):
        _read_rows(payload, name, table, dests, deadline, forced, gate)
        if notify is not None:
            _ask(payload, {"op": _wire.REGION_NOTICE, "message": message}, deadline)
    return int(table[:, 2].sum())


@contextlib.contextmanager
def _mapped_errors(
    region: RegionHandle, timeout: float | None, doing: str, writes: bool = True
) -> Any:
    try:
        yield
    except ProducerLostError as exc:
        cause = str(exc).split(";", 1)[0].removeprefix(f"the producer {region.describe()} ")
        raise ProducerLostError.of_region(region.describe(), f"{doing}, its owner {cause}") from exc
    except TimeoutError as exc:
        wrote = (
            "the destinations may hold some of the bytes, and nothing of this call writes "
            "them any more. "
            if writes
            else "the owner may or may not have it. "
        )
        raise FetchTimeoutError(
            f"{doing} did not finish within {timeout}s ({region.describe()}: {exc}); {wrote}"
            "Pass a larger timeout, or check that the owner is alive and reachable"
        ) from exc


def _read_rows(
    payload: Payload,
    name: str,
    table: np.ndarray,
    dests: list[_Landing],
    deadline: float | None,
    forced: str | None,
    gate: WriteGate | None,
) -> None:
    own = payload.producer.process_token == _process.PROCESS_TOKEN
    if own:
        _check_own(payload)
    plugin = not own and name not in _BYTE_TRANSPORTS and not transport_class(name).byte_transport
    bases = np.fromiter((d.address for d in dests), np.int64, len(dests))
    for start in range(0, len(table), _ROWS_PER_READ):
        ranges = _ranges(table[start : start + _ROWS_PER_READ], dests, bases)
        if plugin:
            _read_plugin(payload, name, ranges, deadline, gate)
        else:
            fetch_ranges(payload, ranges, deadline, forced, gate)


def _ranges(table: np.ndarray, dests: list[_Landing], bases: np.ndarray) -> Ranges:
    """The rows as ``Ranges`` landing in ``dests``."""
    tensor, offset, length, dest, at = (table[:, i].copy() for i in range(5))

    def view(i: int) -> torch.Tensor:
        start = int(at[i])
        return dests[int(dest[i])].flat()[start : start + int(length[i])]

    landing = ByteViews(bases[dest] + at, length, view)
    ones = np.ones(len(table), np.int64)
    return Ranges(tensor, offset, length, ones, length, landing, devices=frozenset({"cpu"}))


def _check_own(payload: Payload) -> None:
    """A read of a region of this very process: open, and the capability its own."""
    region = store.get(payload.obj_id)
    if region is None or not hmac.compare_digest(region.capability, payload.capability):
        raise ProducerLostError.of(payload.producer.describe(), "holds no such region")


def _read_plugin(
    payload: Payload, name: str, ranges: Ranges, deadline: float | None, gate: WriteGate | None
) -> None:
    """One read over one-sided plug-in ``name`` (the module's docstring)."""
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    extract = {"op": _wire.REGION_EXTRACT, "transport": name, "timeout": left}
    answer, frames = _ask(payload, extract, deadline)
    who = payload.producer.describe()
    try:
        read_id = str(answer["read"])
        meta = _wire.decode_value(answer["meta"], [f.bytes for f in frames], metadata_classes())
        one = dataclasses.replace(
            payload, obj_id=bytes.fromhex(read_id), transport=name, transport_meta={name: meta}
        )
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise TransferError(f"corrupt metadata from {who}: {exc}") from exc
    release = {"op": _wire.REGION_RELEASE, "read": read_id}
    try:
        fetch_ranges(one, ranges, deadline, name, gate)
    except BaseException:
        with contextlib.suppress(Exception):  # the read's error is the one to raise
            _ask(payload, release, time.monotonic() + 1.0)
        raise
    _ask(payload, release, deadline)  # "lost" if the region closed while it was read


def _ask(
    payload: Payload, header: dict[str, Any], deadline: float | None
) -> tuple[dict[str, Any], list[Any]]:
    """One request about the region to its owner's agent, and its reply."""
    producer = payload.producer
    with _channel.channel(producer.agent_address) as ch:
        if producer.node_id == _ray.node_id():  # its death is seen by its pid at once
            ch.producer_alive = functools.partial(
                _process.process_alive, producer.pid, producer.start_time
            )
        ch.send(
            {
                **header,
                "obj": payload.obj_id.hex(),
                "cap": payload.capability.hex(),
                "reply": True,
            }
        )
        return ch.recv_reply(deadline, producer.describe())


def _checked_transport(forced: str | None, region: RegionHandle) -> str:
    """The transport the caller forces, or the one named at export; refused
    before a byte moves unless a region can be read over it."""
    name = check_name(forced) if forced is not None else region.transport
    if name in _BYTE_TRANSPORTS:
        return name
    cls = transport_class(name)
    if cls.byte_transport or not cls.is_one_sided():
        raise ValueError(
            f"tensor_transport={name!r}: a region is read over 'auto', 'cma', 'shm', 'tcp' "
            "or a one-sided plug-in transport"
        )
    return name


def _payload_of(region: RegionHandle) -> Payload:
    with _payloads_lock:
        payload = _payloads.get(region)
        if payload is not None:
            _payloads.move_to_end(region)
            return payload
    payload = region.payload()
    with _payloads_lock:
        _payloads[region] = payload
        while len(_payloads) > _CACHED_PAYLOADS:
            _payloads.popitem(last=False)
    return payload


def _notice(message: Any) -> Any:
    """``message`` checked: JSON-serialisable, not None, at most 64 KiB encoded."""
    if message is None:
        raise ValueError("a notice cannot be None: send any other JSON value")
    try:
        encoded = json.dumps(message)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"a notice must be JSON-serialisable: {exc}") from exc
    if len(encoded) > NOTICE_MAX_BYTES:
        raise ValueError(
            f"a notice of {len(encoded)} bytes (JSON) is over {NOTICE_MAX_BYTES}: send ids, "
            "not data (read the data as a region)"
        )
    return message


class _Landing:
    """A destination: where its bytes are, and its flat uint8 view, made only
    where a transport asks for views (``shm``, ``tcp``, plug-ins). A ``cma`` read
    needs addresses alone, and torch's view methods let the GIL go (a wait of
    up to 5 ms each beside a thread running Python, ``transports.cma``)."""

    __slots__ = ("_flat", "address", "nbytes", "tensor")

    def __init__(self, tensor: torch.Tensor, flat: bool) -> None:
        self.tensor = tensor
        self.address = tensor.data_ptr()
        self.nbytes = tensor.numel() * tensor.dtype.itemsize
        self._flat = tensor if flat else None

    def flat(self) -> torch.Tensor:
        if self._flat is None:
            self._flat = self.tensor.detach().reshape(-1).view(torch.uint8)
        return self._flat


def _destinations(into: Any) -> list[_Landing]:
    """Each destination, checked."""
    given = list(into) if isinstance(into, (list, tuple)) else [into]
    if not given:
        raise ValueError("into= needs at least one destination")
    landings = [_destination(d, i) for i, d in enumerate(given)]
    bad = unwritable([landing.tensor for landing in landings])
    if bad is not None:
        raise ValueError(f"destination {bad} {UNWRITABLE}")
    return landings


def _destination(value: Any, i: int) -> _Landing:
    if (
        type(value) is torch.Tensor
        and value.dtype == torch.uint8
        and value.dim() == 1
        and value.device.type == "cpu"
        and value.is_contiguous()
    ):
        return _Landing(value, flat=True)  # what a row lands in (a KV cache's storage)
    if isinstance(value, (bytearray, memoryview)):
        view = memoryview(value)
        if view.readonly or not view.c_contiguous:
            raise ValueError(f"destination {i}: a buffer must be writable and contiguous")
        value = torch.frombuffer(view.cast("B"), dtype=torch.uint8) if view.nbytes else None
        if value is None:
            return _Landing(torch.empty(0, dtype=torch.uint8), flat=True)
    elif isinstance(value, np.ndarray):
        if not value.flags.writeable or not value.flags.c_contiguous or value.dtype.hasobject:
            raise ValueError(f"destination {i}: a numpy array must be writable and C-contiguous")
        value = torch.from_numpy(value)
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"destination {i}: expected a tensor, numpy array or writable buffer, got "
            f"{type(value).__name__}"
        )
    if value.device.type != "cpu":
        raise ValueError(
            f"destination {i} is on {value.device}: regions are read into host memory for "
            "now; read into a CPU tensor, then copy it over"
        )
    kind = not_dense(value)
    if kind is not None:
        raise ValueError(f"destination {i} is {kind}: rows land at byte offsets in a dense tensor")
    if value.is_quantized or not value.is_contiguous():
        raise ValueError(f"destination {i} is not contiguous: rows land at byte offsets in it")
    if value.is_conj() or value.is_neg():
        raise ValueError(f"destination {i} {LAZY_VIEW}")
    return _Landing(value, flat=False)


def _async_pool() -> ThreadPoolExecutor:
    global _async_executor
    with _async_lock:
        if _async_executor is None:
            _async_executor = ThreadPoolExecutor(
                _ASYNC_THREADS, thread_name_prefix="raydirect-region-read"
            )
        return _async_executor


def _forget_after_fork() -> None:
    global _async_executor, _async_lock, _payloads_lock
    _async_executor, _async_lock, _payloads_lock = None, threading.Lock(), threading.Lock()
    _payloads.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
