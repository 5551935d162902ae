"""Which transports exist, and one instance of each per process: names and lookup only.

Built-ins are listed by dotted path and imported on first use, so importing
raydirect never imports a transport's heavy dependency. Transports registered
with ``rd.register_tensor_transport`` are published in Ray's key-value store
(the class pickled by value), so every process of the cluster finds them: actors
created before the registration, actors restarted after it, and processes that
only borrowed an actor handle. Installed packages add transports through the
``raydirect.transports`` entry-point group (``name = "module:Class"``).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, cast

import numpy as np
import ray
import torch
from ray import cloudpickle

from raydirect import _process, _ray
from raydirect.errors import UnknownTransportError
from raydirect.transports.base import TensorTransportManager

log = logging.getLogger("raydirect")

AUTO = "auto"
ENTRY_POINT_GROUP = "raydirect.transports"
DATA_TYPES = (torch.Tensor, np.ndarray)


def _data_type_name(data_type: Any) -> str | None:
    if data_type is torch.Tensor:
        return "torch"
    if data_type is np.ndarray:
        return "numpy"
    jax = sys.modules.get("jax")  # only if the caller imported jax: never imported here
    if jax is not None and data_type is getattr(jax, "Array", None):
        return "jax"
    return None


_BUILTINS: dict[str, str] = {
    "cma": "raydirect.transports.cma:CmaTransport",
    "cuda_ipc": "raydirect.transports.cuda_ipc:CudaIpcTransport",
    "gloo": "raydirect.transports.gloo:GlooTransport",
    "nccl": "raydirect.transports.nccl:NcclTransport",
    "nixl": "raydirect.transports.nixl:NixlTransport",
    "shm": "raydirect.transports.shm:ShmTransport",
    "tcp": "raydirect.transports.tcp:TcpTransport",
}


@dataclass(frozen=True)
class Registration:
    name: str
    cls: type[TensorTransportManager]
    devices: tuple[str, ...]
    # By name ("torch", "numpy", "jax"), not the class: pickled by value with the
    # registration, a class object could arrive as a copy that nothing is an instance of.
    data_type_name: str = "torch"

    @property
    def data_type(self) -> type:
        if self.data_type_name == "numpy":
            return np.ndarray
        if self.data_type_name == "jax":
            import jax  # a JAX-typed transport: this process deals in JAX arrays

            return cast(type, jax.Array)
        return torch.Tensor


_registrations: dict[str, Registration] = {}
_unpublished: dict[str, bytes] = {}  # registered before Ray was connected
_instances: dict[str, TensorTransportManager] = {}
_lock = threading.RLock()


def _dumps_by_value(registration: Registration) -> bytes:
    """Pickle the registration with its class *by value*, and the classes it
    derives from outside raydirect and the libraries: the consumer's process need
    not be able to import the modules that defined them."""
    names = {
        c.__module__
        for c in registration.cls.__mro__
        if c.__module__ not in ("builtins", "abc", "__main__")  # __main__: by value anyway
        and c.__module__.split(".")[0] not in ("raydirect", "torch", "numpy", "ray", "jax")
    }
    listed = set(cloudpickle.list_registry_pickle_by_value())
    modules = [sys.modules[n] for n in sorted(names - listed) if n in sys.modules]
    for module in modules:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(registration)
    finally:
        for module in modules:
            cloudpickle.unregister_pickle_by_value(module)


def register_tensor_transport(
    name: str,
    devices: Sequence[str],
    manager_cls: type[TensorTransportManager],
    data_type: type = torch.Tensor,
    *,
    replace: bool = False,
) -> None:
    """Make a transport known to every process of the cluster, now and later.

    ``manager_cls`` subclasses ``rd.TensorTransportManager`` (Ray RDT's method
    names; a transport written for Ray ports by changing its imports).
    ``devices`` are the device types whose memory it moves; ``data_type`` is what
    it is handed: ``torch.Tensor`` or ``numpy.ndarray`` (the rest of the value
    travels pickled). Call it at any time, from any process: methods may name a
    transport that is registered only later (checked at call time). A taken
    name raises ``ValueError`` unless ``replace=True``. Nothing is registered
    when it raises.
    """
    data_type_name = _checked_registration(name, devices, manager_cls, data_type)
    registration = Registration(name, manager_cls, tuple(devices), data_type_name)
    blob = _dumps_by_value(registration)
    with _lock:
        if not replace and _lookup(name) is not None:
            raise ValueError(
                f"a tensor transport named {name!r} is already registered; "
                "pass replace=True to replace it"
            )
        _registrations[name] = registration
        _instances.pop(name, None)
        if ray.is_initialized():
            _ray.put_transport_record(name, blob)
        else:
            _unpublished[name] = blob


def _checked_registration(
    name: str, devices: Sequence[str], manager_cls: Any, data_type: type
) -> str:
    """Refuse a registration that cannot work, naming the fix; the data type's name."""
    if not isinstance(manager_cls, type) or not issubclass(manager_cls, TensorTransportManager):
        raise TypeError(
            f"manager_cls must be a subclass of rd.TensorTransportManager, got {manager_cls!r}"
        )
    if manager_cls.byte_transport:
        raise TypeError(
            "byte transports are built into raydirect; subclass "
            "rd.TensorTransportManager for a plug-in"
        )
    if not isinstance(name, str) or not name or name == AUTO or name in _BUILTINS:
        raise ValueError(
            f"cannot register a transport named {name!r}: pick a name other than "
            f"'auto' and the built-ins ({', '.join(sorted(_BUILTINS))})"
        )
    if isinstance(devices, str) or not devices or not all(isinstance(d, str) for d in devices):
        raise ValueError(
            f"devices must be a non-empty list of device types such as ['cpu'], got {devices!r}"
        )
    data_type_name = _data_type_name(data_type)
    if data_type_name is None:
        raise TypeError(
            f"data_type must be torch.Tensor, numpy.ndarray or jax.Array, got {data_type!r}"
        )
    return data_type_name


def _publish_unpublished() -> None:
    if _unpublished and ray.is_initialized():
        with _lock:
            for name, blob in _unpublished.items():
                _ray.put_transport_record(name, blob)
            _unpublished.clear()


def _builtin(name: str) -> Registration:
    module, _, attr = _BUILTINS[name].partition(":")
    cls = getattr(importlib.import_module(module), attr)
    return Registration(name, cls, cls.devices)


def _from_entry_point(name: str) -> Registration | None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            cls = ep.load()
            return Registration(name, cls, tuple(cls.devices))
    return None


def _lookup(name: str) -> Registration | None:
    """The registration of ``name``: built-in, this process's, the cluster's, or
    an installed package's; None if nobody registered it (yet)."""
    reg = _registrations.get(name)
    if reg is not None:
        return reg
    if name in _BUILTINS:
        reg = _builtin(name)
    else:
        blob = _ray.transport_record(name) if ray.is_initialized() else None
        reg = cloudpickle.loads(blob) if blob is not None else _from_entry_point(name)
    if reg is not None:
        _registrations[name] = reg
    return reg


def registration(name: str) -> Registration:
    with _lock:
        _publish_unpublished()
        reg = _lookup(name) if isinstance(name, str) else None
    if reg is None:
        raise UnknownTransportError(name, known_names())
    return reg


def known_names() -> list[str]:
    names = {AUTO, *_BUILTINS, *_registrations}
    if ray.is_initialized():
        names |= set(_ray.transport_records())
    names |= {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return sorted(names)


def check_name(name: object) -> str:
    """``name`` if it names a transport (or ``auto``), else UnknownTransportError."""
    if name == AUTO:
        return AUTO
    return registration(name).name  # type: ignore[arg-type]


def transport_class(name: str) -> type[TensorTransportManager]:
    return registration(name).cls


def transport_instance(name: str) -> TensorTransportManager:
    inst = _instances.get(name)
    if inst is None:
        with _lock:
            inst = _instances.get(name)
            if inst is None:
                inst = transport_class(name)()
                _instances[name] = inst
    return inst


def _forget_after_fork() -> None:
    # Transport instances hold the parent's state (its shared-memory segments,
    # NIXL registrations): the child makes its own on first use.
    global _instances, _lock
    _process.keep_from_parent(_instances)
    _instances, _lock = {}, threading.RLock()


os.register_at_fork(after_in_child=_forget_after_fork)
