"""Which transport reads an object in this process.

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
                       warning once. A process that encrypts refuses to read
                       bytes from another node in clear (``tcp`` from a
                       producer that does not encrypt, or a clear transport
                       named), unless ``RAYDIRECT_ALLOW_CLEAR=1``
A declared same-node transport read from another node, and a two-sided
transport read outside the producer's group (the driver, a non-member), fall
back to ``tcp``, logged once per process.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

from raydirect import _ray, _tls, _wire
from raydirect._payload import Payload, ProducerInfo
from raydirect.errors import GroupError, TransferError, TransportUnavailableError
from raydirect.transports import nixl_agent
from raydirect.transports.registry import AUTO, check_name, transport_class, transport_instance

log = logging.getLogger("raydirect")

SAME_NODE = "cma"
SAME_NODE_FALLBACK = "shm"
_SAME_NODE_CUDA = "cuda_ipc"
CROSS_NODE = "tcp"
CROSS_NODE_ENGINE = "nixl"
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


refused_cma = _Refusals()  # producers whose memory the kernel refuses to cross-read
refused_nixl = _Refusals()  # ... and those nixl failed to read
_logged_fallbacks: set[Any] = set()
_lock = threading.Lock()


def choose_transport(payload: Payload, forced: str | None) -> str:
    """The transport this process uses to read ``payload`` (not for same-process
    reads); ``TransferError`` if its bytes would cross from another node in clear
    while this process encrypts (``_refuse_clear``)."""
    same_node = payload.producer.node_id == _ray.node_id()
    choice = _choose(payload, forced, same_node)
    if not same_node:
        _refuse_clear(payload, choice)
    return choice


def _choose(payload: Payload, forced: str | None, same_node: bool) -> str:
    wanted = check_name(forced or payload.transport)
    producer = payload.producer
    if wanted == AUTO:
        choice = _choose_auto(payload, same_node)
        log.debug("raydirect: auto chose %r for an object of %s", choice, producer.describe())
        return choice
    if transport_class(wanted).same_node_only and not same_node:
        _log_fallback_once(wanted, "reaches only the producer's node; objects from other nodes")
        return CROSS_NODE
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
            return CROSS_NODE
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
        return CROSS_NODE
    return wanted


def _refuse_clear(payload: Payload, choice: str) -> None:
    """A read from another node over ``choice``: refused when this process encrypts
    and the bytes would cross in clear (``tcp`` from a producer whose stream port
    has no TLS, or a transport raydirect does not encrypt), unless
    ``RAYDIRECT_ALLOW_CLEAR=1``; named under encryption, a clear one warns once.
    Plug-in transports encrypt or not by themselves: not judged here."""
    sealed = _wire.TLS_MARK in payload.producer.agent_address
    clear = choice in _CLEAR_ACROSS_NODES or (choice == CROSS_NODE and not sealed)
    if not clear:
        return
    if _tls.encryption_wanted() and not _tls.clear_allowed():
        how = (
            "its stream port does not encrypt: set RAYDIRECT_ENCRYPT=1 in the producer's "
            "environment too (the job's or the actor's runtime_env env_vars)"
            if choice == CROSS_NODE
            else f"{choice!r} moves bytes in clear: read it with 'auto' or 'tcp'"
        )
        raise TransferError(
            f"this process encrypts ({_tls.encryption_setting()}) and refuses to read the "
            f"object of {payload.producer.describe()}, on another node, in clear: {how}; "
            f"or set {_tls.ALLOW_CLEAR_ENV}=1 here to read clear bytes from other nodes "
            "(a cluster mixing encrypting and clear processes)"
        )
    if choice in _CLEAR_ACROSS_NODES and _encrypting(payload):
        _warn_clear_once(choice)


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
        if producer in refused_cma:
            return SAME_NODE_FALLBACK
        return SAME_NODE
    if _encrypting(payload):  # never a transport that moves bytes in clear across machines
        return CROSS_NODE
    if (
        CROSS_NODE_ENGINE in producer.transports
        and producer not in refused_nixl
        and nixl_agent.installed()
    ):
        return CROSS_NODE_ENGINE
    backend = "nccl" if cuda else "gloo"  # a group both are in, if any
    groups = payload.transport_meta.get(backend)
    if groups is not None and transport_instance(backend).reachable(groups):
        return backend
    return CROSS_NODE


def _log_fallback_once(wanted: str, why: str) -> None:
    with _lock:
        first = wanted not in _logged_fallbacks
        _logged_fallbacks.add(wanted)
    if first:  # once per process, not per transfer
        log.warning("raydirect: %r %s read over %r", wanted, why, CROSS_NODE)
