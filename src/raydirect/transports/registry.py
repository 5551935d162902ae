"""Which transports exist, and one instance of each per process.

Built-ins are listed by dotted path and imported on first use, so importing
raydirect never imports a transport's heavy dependency.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from raydirect.errors import UnknownTransportError
from raydirect.transports.base import TensorTransportManager

if TYPE_CHECKING:
    from raydirect._store import StoredObject

log = logging.getLogger("raydirect")

AUTO = "auto"

_BUILTINS: dict[str, str] = {
    "cma": "raydirect.transports.cma:CmaTransport",
    "gloo": "raydirect.transports.gloo:GlooTransport",
    "nccl": "raydirect.transports.nccl:NcclTransport",
    "shm": "raydirect.transports.shm:ShmTransport",
    "tcp": "raydirect.transports.tcp:TcpTransport",
}

_classes: dict[str, type[TensorTransportManager]] = {}
_instances: dict[str, TensorTransportManager] = {}
_lock = threading.Lock()


def known_names() -> list[str]:
    return sorted({AUTO, *_BUILTINS, *_classes})


def registered() -> Mapping[str, str]:
    """Read-only view: name -> where its class comes from."""
    return MappingProxyType({**_BUILTINS, **{n: c.__qualname__ for n, c in _classes.items()}})


def check_name(name: object) -> str:
    """``name`` if it names a transport (or ``auto``), else UnknownTransportError."""
    if not isinstance(name, str) or name not in known_names():
        raise UnknownTransportError(name, known_names())
    return name


def transport_class(name: str) -> type[TensorTransportManager]:
    cls = _classes.get(name)
    if cls is not None:
        return cls
    path = _BUILTINS.get(name)
    if path is None:
        raise UnknownTransportError(name, known_names())
    module, _, attr = path.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    _classes[name] = cls
    return cls


def transport_instance(name: str) -> TensorTransportManager:
    inst = _instances.get(name)
    if inst is None:
        with _lock:
            inst = _instances.get(name)
            if inst is None:
                inst = transport_class(name)()
                _instances[name] = inst
    return inst


def release_state(obj: StoredObject) -> None:
    """Let every transport that set something up for ``obj`` release it."""
    for name, meta in list(obj.transport_state.items()):
        try:
            transport_instance(name).garbage_collect(obj.obj_id, meta, obj.buffers)
        except Exception:
            log.exception("raydirect: %s garbage_collect failed for %s", name, obj.obj_id.hex())
    obj.transport_state.clear()


def on_agent_start() -> None:
    """Node-level housekeeping when a process starts serving: remove what dead
    producers on this node left behind."""
    from raydirect.transports.shm import sweep_dead_segments

    sweep_dead_segments()
