"""Plug-in transfers: how a consumer receives over a registered transport.

Plug-ins follow Ray RDT's contract and receive on their own terms; the
orchestration around them is written once, here. One-sided: the consumer
fetches (``fetch_multiple_tensors``/``wait_fetch_complete``). Two-sided: the
consumer makes the communicator metadata, asks the producer's agent to run
``send_multiple_tensors`` (op ``send``) and, once the agent has accepted,
runs ``recv_multiple_tensors`` on a thread of its own while it watches the
deadline, the producer's liveness and the agent's word on the send. Either way
a failure aborts both sides where the transport can abort, and what arrived is
checked against the object's metadata.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

import numpy as np
import torch

from raydirect import _channel, _ray, _wire
from raydirect._payload import Payload
from raydirect._store import store
from raydirect._tensors import finish
from raydirect.errors import ProducerLostError, TransferError
from raydirect.transports.base import PeerMetadata, TensorTransportManager
from raydirect.transports.registry import registration

log = logging.getLogger("raydirect")
_SLICE_S = 0.02  # how often a two-sided receive looks at the agent's channel


def receive(
    name: str,
    transport: TensorTransportManager,
    payload: Payload,
    meta: Any,
    deadline: float | None,
) -> list[Any]:
    """The object's tensors received over plug-in ``name``; ``meta`` is what the
    producer extracted. ``TransferError`` naming the transport on failure."""
    who = payload.producer.describe()
    check_device(name, meta, payload)
    comm: Any = None
    try:
        if transport.is_one_sided():
            comm = transport.get_communicator_metadata(None, _ray.current_actor_handle(), name)
            request = transport.fetch_multiple_tensors(payload.obj_id.hex(), meta, comm, None)
            remaining = -1.0 if deadline is None else max(0.0, deadline - time.monotonic())
            tensors = list(transport.wait_fetch_complete(request, remaining))
        else:
            comm = transport.get_communicator_metadata(
                payload.actor, _ray.current_actor_handle(), name
            )
            tensors = _two_sided(name, transport, payload, meta, comm, deadline)
    except (ProducerLostError, TimeoutError):
        if comm is not None and transport.can_abort_transport():
            _abort_both_sides(transport, name, payload, comm)
        raise
    except Exception as exc:
        if comm is not None and transport.can_abort_transport():
            _abort_both_sides(transport, name, payload, comm)
        if isinstance(exc, TransferError):  # the agent's word on a failed send names it
            raise
        raise TransferError(
            f"transport {name!r} failed to receive the object of {who}: {type(exc).__name__}: {exc}"
        ) from exc
    problem = _mismatch(tensors, payload.metas)
    if problem:
        raise TransferError(f"transport {name!r} returned {problem} for the object of {who}")
    store.count_received(name, payload.nbytes)
    return [
        finish(t, m) if isinstance(t, torch.Tensor) else t
        for t, m in zip(tensors, payload.metas, strict=True)
    ]


def check_device(name: str, meta: Any, payload: Payload) -> None:
    """Refuse, before anything is received, metadata whose ``tensor_device`` the
    plug-in was not registered for, or that is not where the object's tensors
    are: a receive set up for the wrong device would otherwise fail later, inside
    the plug-in, with an error that says nothing of the cause (or succeed on a
    device the registration never promised). ``TransferError`` naming the
    device, the registration and the fix; nothing is asked of the producer."""
    device = getattr(meta, "tensor_device", None)
    if device is None:  # the plug-in does not say: nothing to check
        return
    kind = str(device).split(":", 1)[0]
    devices = registration(name).devices
    said = (
        f"plug-in transport {name!r} reported tensor_device={str(device)!r} in the metadata its "
        f"extract_tensor_transport_metadata made for the object of {payload.producer.describe()}"
    )
    if kind not in devices:
        raise TransferError(
            f"{said}, but it does not support {kind!r}: it was registered for "
            f"{'/'.join(devices)} (rd.register_tensor_transport({name!r}, {list(devices)}, ...)). "
            f"Register it for {kind!r} too (replace=True), or make "
            "extract_tensor_transport_metadata report the device its tensors are on"
        )
    actual = set(payload.metas.devices)
    if actual and actual != {kind}:
        raise TransferError(
            f"{said}, but the object's tensors are on {'/'.join(sorted(actual))}: make "
            "extract_tensor_transport_metadata report the device its tensors are on"
        )


def encoded_comm(comm: Any) -> dict[str, Any]:
    """Communicator metadata as request fields: JSON, byte strings in base64."""
    frames: list[bytes] = []
    data = _wire.encode_value(comm, frames)
    return {"comm": data, "comm_frames": [base64.b64encode(f).decode() for f in frames]}


def _two_sided(
    name: str,
    transport: TensorTransportManager,
    payload: Payload,
    meta: Any,
    comm: Any,
    deadline: float | None,
) -> list[Any]:
    producer = payload.producer
    who = producer.describe()
    link = PeerMetadata(producer, payload.capability, deadline, producer.node_id == _ray.node_id())
    _abandoned.check(name)
    with _channel.channel(producer.agent_address) as ch:
        if link.same_node:
            ch.producer_alive = link.producer_alive
        ch.send(
            {
                "op": _wire.SEND,
                "obj": payload.obj_id.hex(),
                "cap": payload.capability.hex(),
                "transport": name,
                "timeout": link.remaining(),  # bounds the producer's wait for preparation
                **encoded_comm(comm),
            }
        )
        ch.recv_reply(deadline, who)  # accepted: the producer sends from now on
        received: Future[list[Any]] = Future()
        receiver = threading.Thread(
            target=_run_receive,
            args=(received, transport, payload, meta, comm),
            name="raydirect-recv",
            daemon=True,
        )
        receiver.start()
        try:
            return _await(ch, received, deadline, f"the {name} transfer from {who}", who)
        except BaseException:
            _abandoned.add(name, receiver)  # aborted below where the plug-in can abort
            raise


def _await(
    ch: _channel.Channel, received: Future[list[Any]], deadline: float | None, what: str, who: str
) -> list[Any]:
    """The received tensors, once the agent has also said its send ended (so no
    reply is left in the channel); the agent's refusal, the receive's error,
    the producer's loss or the deadline first, whichever comes."""
    sent = False
    while True:
        if not sent and ch.socket.poll(0):
            ch.recv_reply(deadline, who)  # the send failed: TransferError naming the transport
            sent = True
        if received.done():
            if sent or received.exception() is not None:
                return received.result()
            ch.wait_readable(deadline, who)
            continue
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not finish before the deadline")
        ch.check_peer(who)
        with contextlib.suppress(FutureTimeoutError):  # still receiving: look again
            received.exception(timeout=_SLICE_S)


class _Abandoned:
    """Receive threads of two-sided plug-in transfers given up on (the deadline,
    the producer's loss, a failed send) that have not returned. A plug-in that
    aborts ends them; one that cannot would leave a thread per attempt, so past
    ``MAX_ABANDONED`` still running for one transport, this process starts no
    more of its receives and says why."""

    MAX_ABANDONED = 4

    def __init__(self) -> None:
        self._threads: dict[str, list[threading.Thread]] = {}
        self._lock = threading.Lock()

    def add(self, name: str, thread: threading.Thread) -> None:
        with self._lock:
            self._threads.setdefault(name, []).append(thread)

    def running(self, name: str) -> int:
        with self._lock:
            alive = [t for t in self._threads.get(name, []) if t.is_alive()]
            self._threads[name] = alive
            return len(alive)

    def check(self, name: str) -> None:
        stuck = self.running(name)
        if stuck >= self.MAX_ABANDONED:
            raise TransferError(
                f"{stuck} receives over plug-in transport {name!r} were given up on and never "
                "returned, so this process starts no more of them: make the plug-in's "
                "recv_multiple_tensors return after abort_transport (and can_abort_transport "
                "return True), or restart this process"
            )


_abandoned = _Abandoned()


def _run_receive(
    received: Future[list[Any]],
    transport: TensorTransportManager,
    payload: Payload,
    meta: Any,
    comm: Any,
) -> None:
    # A thread of its own, not a pool: a receive that never returns (a transport
    # that cannot abort) must not take a worker others wait for.
    try:
        received.set_result(
            list(transport.recv_multiple_tensors(payload.obj_id.hex(), meta, comm, None))
        )
    except BaseException as exc:  # handed to the waiting consumer
        received.set_exception(exc)


def _abort_both_sides(
    transport: TensorTransportManager, name: str, payload: Payload, comm: Any
) -> None:
    obj_id = payload.obj_id.hex()
    try:
        transport.abort_transport(obj_id, comm)
        header = {
            "op": _wire.ABORT,
            "obj": obj_id,
            "cap": payload.capability.hex(),
            "transport": name,
        }
        _channel.notify(payload.producer.agent_address, {**header, **encoded_comm(comm)})
    except Exception:  # aborting is best effort; the failure is reported either way
        log.debug("raydirect: aborting %s failed", name, exc_info=True)


def _mismatch(received: list[Any], metas: Sequence[Any]) -> str | None:
    if len(received) != len(metas):
        return f"{len(received)} tensors where {len(metas)} were due"
    for i, (got, meta) in enumerate(zip(received, metas, strict=True)):
        shape = tuple(getattr(got, "shape", ()))
        if isinstance(got, np.ndarray):
            dtype_ok = meta.np_dtype is None or got.dtype.str == meta.np_dtype
        else:
            dtype_ok = str(getattr(got, "dtype", "")).removeprefix("torch.") == meta.dtype
        if shape != tuple(meta.shape) or not dtype_ok:
            return f"tensor {i} of shape {shape} and dtype {getattr(got, 'dtype', '?')}"
    return None


def _forget_after_fork() -> None:
    global _abandoned
    _abandoned = _Abandoned()  # the parent's receive threads are not ours


os.register_at_fork(after_in_child=_forget_after_fork)
