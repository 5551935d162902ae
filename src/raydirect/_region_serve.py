"""Long-lived regions, the owner's agent's side: the open regions, and the ops
readers send about them.

``_regions`` adds a region here when it is exported and takes it out when it
closes; the agent's handlers find it by id (the server has already checked the
capability): a reader's notice (``region_notice``), queued for
``Region.notices()`` or handed to the region's ``on_notice`` on the dispatcher
thread, which sleeps while none comes; a plug-in's metadata for one read
(``region_extract``), made from the tensors as they are then; and the end of
that read (``region_release``), answered "lost" if the region closed meanwhile.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from raydirect import _process, _server, _wire
from raydirect._server import CONTROL, DATA, Reply
from raydirect._store import StoredObject
from raydirect.errors import ProducerLostError, TransferError
from raydirect.transports.registry import registration, transport_instance

log = logging.getLogger("raydirect")

_INBOX_MAX = 1 << 16  # notices waiting for Region.notices(); more are refused
# A prepared plug-in read whose reader's deadline passed this long ago is
# released without it: the reader gave up (a timeout during the preparation left
# it without the read's id) or died, and a plug-in that stages a copy would keep
# one per such read for the region's life.
ABANDONED_AFTER_S = 30.0


@dataclass
class OpenRegion:
    """One open region, as its owner's agent sees it."""

    obj: StoredObject
    on_notice: Callable[[Any], None] | None
    inbox: collections.deque[Any] = field(default_factory=collections.deque)
    cond: threading.Condition = field(default_factory=threading.Condition)
    # Plug-in reads prepared from it and not yet released: read id -> (transport,
    # metadata, when it may be released without its reader: monotonic, or None).
    reads: dict[str, tuple[str, Any, float | None]] = field(default_factory=dict)
    closed: bool = False


_open: dict[bytes, OpenRegion] = {}
_open_lock = threading.Lock()


def add(state: OpenRegion) -> None:
    with _open_lock:
        _open[state.obj.obj_id] = state


def remove(obj_id: bytes) -> None:
    with _open_lock:
        _open.pop(obj_id, None)


def names() -> list[str]:
    """The names of this process's open regions."""
    with _open_lock:
        return [s.obj.label for s in _open.values() if not s.closed]


def release_reads(state: OpenRegion, abandoned_by: float | None = None) -> None:
    """Release the plug-in reads still prepared from a region: every one (it is
    closing), or those whose reader's deadline ended before ``abandoned_by``
    (on each extract and release: what they leave behind is bounded by the
    region's use)."""
    with state.cond:
        gone = [
            r
            for r, (_, _, end) in state.reads.items()
            if abandoned_by is None or (end is not None and end < abandoned_by)
        ]
        dropped = [(r, state.reads.pop(r)) for r in gone]
    for read_id, (name, meta, _) in dropped:
        _garbage_collect(name, read_id, meta, state.obj)


def _state_of(obj: StoredObject) -> OpenRegion:
    with _open_lock:
        state = _open.get(obj.obj_id)
    if state is None or state.closed:
        raise ProducerLostError.freed_meanwhile()
    return state


def _serve_notice(obj: StoredObject, request: dict[str, Any], reply: Reply) -> None:
    state = _state_of(obj)
    message = request.get("message")
    if state.on_notice is not None:
        dispatcher.submit(state.on_notice, message, obj.label)
    else:
        with state.cond:
            if len(state.inbox) >= _INBOX_MAX:
                raise TransferError(
                    f"region {obj.label!r} has {_INBOX_MAX} notices nobody took: its owner "
                    "must call region.notices()"
                )
            state.inbox.append(message)
            state.cond.notify_all()
    reply.send({"ok": True})


def _serve_extract(obj: StoredObject, request: dict[str, Any], reply: Reply) -> None:
    """A plug-in's metadata for one read: extracted from the tensors as they are
    now (a plug-in that stages a copy then stages the current bytes), released
    by ``region_release`` once the read ends."""
    state = _state_of(obj)
    name = str(request.get("transport", ""))
    cls = registration(name).cls
    if cls.byte_transport or not cls.is_one_sided():
        raise ValueError(f"{name!r} is not a one-sided plug-in transport")
    tensors = obj.originals
    if registration(name).data_type is np.ndarray:
        tensors = [t.numpy() if isinstance(t, torch.Tensor) else t for t in tensors]
    timeout = request.get("timeout")
    if timeout is not None and (type(timeout) not in (int, float) or not timeout >= 0):
        raise ValueError(f"timeout={timeout!r}: a number of seconds >= 0, or None")
    end = None if timeout is None else time.monotonic() + timeout + ABANDONED_AFTER_S
    release_reads(state, abandoned_by=time.monotonic())
    read_id = _process.new_id().hex()
    with obj.serving():
        meta = transport_instance(name).extract_tensor_transport_metadata(read_id, tensors)
        with state.cond:
            state.reads[read_id] = (name, meta, end)
    frames: list[bytes] = []
    reply.send({"ok": True, "read": read_id, "meta": _wire.encode_value(meta, frames)}, *frames)


def _serve_release(obj: StoredObject, request: dict[str, Any], reply: Reply) -> None:
    """A plug-in read ended. Answered "lost" (by the server, or here) if the
    region closed meanwhile: the reader then fails, whatever it read."""
    state = _state_of(obj)
    with state.cond:
        found = state.reads.pop(str(request.get("read", "")), None)
    release_reads(state, abandoned_by=time.monotonic())
    if found is None:  # what it read may be gone: the reader must not return it
        raise TransferError(
            f"region {obj.label!r} released this read before it ended: its deadline had "
            f"passed {ABANDONED_AFTER_S:g}s before (read it again)"
        )
    _garbage_collect(found[0], str(request.get("read")), found[1], obj)
    reply.send({"ok": True})


def _garbage_collect(name: str, read_id: str, meta: Any, obj: StoredObject) -> None:
    try:
        transport_instance(name).garbage_collect(read_id, meta, obj.originals)
    except Exception:
        log.exception("raydirect: %s garbage_collect failed for a read of %s", name, obj.label)


class _Dispatcher:
    """The thread that runs ``on_notice`` callbacks, in arrival order, started on
    the first notice; it sleeps on its queue while none comes."""

    def __init__(self) -> None:
        self._queue: collections.deque[tuple[Callable[[Any], None], Any, str]] = collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[Any], None], message: Any, label: str) -> None:
        with self._cond:
            self._queue.append((fn, message, label))
            self._cond.notify()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="raydirect-region-notices", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                fn, message, label = self._queue.popleft()
            try:
                fn(message)
            except Exception:
                log.exception("raydirect: the on_notice callback of region %r failed", label)


dispatcher = _Dispatcher()

_server.register(_wire.REGION_NOTICE, _serve_notice, needs_object=True, lane=CONTROL)
_server.register(_wire.REGION_EXTRACT, _serve_extract, needs_object=True, lane=DATA)
_server.register(_wire.REGION_RELEASE, _serve_release, needs_object=True, lane=CONTROL)


def _forget_after_fork() -> None:
    # The parent's regions are the parent's: the store forgot them too.
    global _open, _open_lock, dispatcher
    _process.keep_from_parent(_open, dispatcher)
    _open, _open_lock, dispatcher = {}, threading.Lock(), _Dispatcher()


os.register_at_fork(after_in_child=_forget_after_fork)
