"""The producer's side of a two-sided plug-in's transfer: the send it runs when a
consumer asks (``_wire.SEND``), and its aborts: the consumer's (``_wire.ABORT``,
its receive failed or ran out of time) and the free's (an object freed while its
send still runs, which no consumer can want; a consumer's abort arriving after
the free finds no object to abort)."""

from __future__ import annotations

import base64
import logging
import threading
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

from raydirect import _server, _wire
from raydirect._server import CONTROL, PLUGIN, Reply
from raydirect._store import StoredObject, store
from raydirect.transports.base import CommunicatorMetadata, metadata_classes
from raydirect.transports.registry import transport_instance

log = logging.getLogger(__name__)

# Two-sided plug-in sends running now: object id -> (transport, communicator metadata).
_sending: dict[bytes, list[tuple[Any, Any]]] = {}
_sending_lock = threading.Lock()


def abort_sends(obj: StoredObject) -> None:
    """Abort ``obj``'s sends still running (it is being freed)."""
    for transport, comm in _sends_of(obj.obj_id):
        _abort(transport, obj, comm)


def _sends_of(obj_id: bytes) -> list[tuple[Any, Any]]:
    """The sends of ``obj_id`` still running, forgotten here: each is aborted once."""
    with _sending_lock:
        return _sending.pop(obj_id, [])


def _abort(transport: Any, obj: StoredObject, comm: Any) -> None:
    if transport.can_abort_transport():
        try:
            transport.abort_transport(obj.obj_id.hex(), comm)
        except Exception:
            log.exception("raydirect: abort_transport failed for %s", obj.label)


def _serve_abort(obj: StoredObject, request: dict[str, Any], reply: Reply) -> None:
    transport = transport_instance(str(request.get("transport", "")))
    _sends_of(obj.obj_id)  # aborted now: a free that follows has nothing to abort
    if transport.can_abort_transport():
        comm = _decoded_comm(request) if "comm" in request else CommunicatorMetadata()
        transport.abort_transport(obj.obj_id.hex(), comm)


def _decoded_comm(request: dict[str, Any]) -> Any:
    frames = [base64.b64decode(f) for f in request.get("comm_frames", [])]
    return _wire.decode_value(request["comm"], frames, metadata_classes())


def _serve_send(obj: StoredObject, request: dict[str, Any], reply: Reply) -> None:
    """A two-sided plug-in: accept, then send while the consumer receives, then
    say how the send ended (the consumer waits for both answers). In a lane of
    its own: a plug-in that cannot abort may hold its thread for as long as its
    send hangs, and only other plug-in sends wait behind it."""
    name = str(request.get("transport", ""))
    transport = transport_instance(name)
    if transport.byte_transport or transport.is_one_sided() or obj.transport != name:
        raise ValueError(f"the object was not made for two-sided transport {name!r}")
    comm = _decoded_comm(request)
    try:
        meta = _wait_prepared(obj, name, request.get("timeout"))
    except FutureTimeoutError:
        reply.send(_wire.refusal(_wire.TRANSFER, f"{name} still preparing at the deadline"))
        return
    reply.send({"ok": True})
    obj.check_unmodified()
    sending = (transport, comm)
    with _sending_lock:
        _sending.setdefault(obj.obj_id, []).append(sending)
    try:
        transport.send_multiple_tensors(obj.originals, meta, comm)
    except Exception as exc:
        log.exception("raydirect: %s send of %s failed", name, obj.label)
        _abort(transport, obj, comm)
        error = f"transport {name!r} failed to send: {type(exc).__name__}: {exc}"
        reply.send(_wire.refusal(_wire.TRANSFER, error))
        return
    finally:
        with _sending_lock:
            running = _sending.get(obj.obj_id, [])
            running[:] = [s for s in running if s is not sending]
            if not running:
                _sending.pop(obj.obj_id, None)
    store.count_sent(name, obj.nbytes)
    reply.send({"ok": True, "sent": True})


def _wait_prepared(obj: StoredObject, name: str, timeout: Any) -> Any:
    """Transport ``name``'s metadata for ``obj``, waiting for background
    preparation up to the consumer's ``timeout`` (None: its read has no deadline)."""
    future = obj.preparing.get(name)
    if future is None:
        return obj.transport_state.get(name)
    return future.result(timeout=None if timeout is None else max(float(timeout), 0.0))


_server.register(_wire.ABORT, _serve_abort, needs_object=True, lane=CONTROL)
_server.register(_wire.SEND, _serve_send, needs_object=True, lane=PLUGIN)
