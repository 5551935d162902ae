"""One object to many actors, reading the producer once per node.

``rd.broadcast(ref, actors)`` returns one ref per actor. On every node that
holds two or more of the actors, the first of them (the *relay*) reads the
object from the producer once and keeps its copy as a raydirect object of
its own; the other actors on that node read from the relay, over the
same-node transports. An actor alone on its node reads from the producer
directly. The producer therefore serves one read per node, however many
consumers each node holds, and is free for its next step sooner.

The relay runs as a short task on the relay actor (Ray's ``__ray_call__``),
queued behind that actor's running methods. Its copy lives as long as any of
the returned refs, like every raydirect object. Within the relay actor the
value read through its ref is that copy itself: write to it in place only
after the others have read it (``rd.wait_tensor_freed``), or read with
``into=``, which copies into your own tensors.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import ray
from ray.actor import ActorHandle

from raydirect import _ray
from raydirect._api import get
from raydirect._payload import Payload, PendingFetch, get_deferred
from raydirect._producer import export
from raydirect._timeouts import checked_timeout
from raydirect.transports.registry import AUTO

log = logging.getLogger("raydirect")


def _node_of(_actor: Any) -> str:
    return ray.get_runtime_context().get_node_id()


# Actor id -> node id, most recently used last, bounded. An actor restarted on
# another node only makes a relay choice worse (its readers then read across
# nodes), never wrong.
_NODES_KEPT = 4096
_node_cache: OrderedDict[str, str] = OrderedDict()
_node_lock = threading.Lock()


def _nodes_of(actors: list[ActorHandle], timeout: float | None) -> list[str]:
    ids = [_ray.actor_id_of(a) for a in actors]
    with _node_lock:
        unknown = {i: a for i, a in zip(ids, actors, strict=True) if i not in _node_cache}
    found = ray.get([_ray.run_in_actor(a, _node_of) for a in unknown.values()], timeout=timeout)
    with _node_lock:
        _node_cache.update(zip(unknown, found, strict=True))
        nodes = []
        for i in ids:
            _node_cache.move_to_end(i)
            nodes.append(_node_cache[i])
        while len(_node_cache) > _NODES_KEPT:
            _node_cache.popitem(last=False)
    return nodes


def _relay(_actor: Any, boxed: list[ray.ObjectRef], timeout: float | None) -> Any:
    value = get(boxed[0], timeout=timeout)
    return export(value, AUTO, label=f"{_ray.current_task_label()} relay")


def broadcast(
    ref: ray.ObjectRef, actors: Sequence[ActorHandle], *, timeout: float | None = None
) -> list[ray.ObjectRef]:
    """Refs to deliver ``ref``'s value to ``actors`` (one per actor, in order)
    with the producer read once per node: pass ``refs[i]`` to ``actors[i]``.
    ``timeout`` bounds the relays' reads (``rd.FetchTimeoutError``)."""
    timeout = checked_timeout(timeout)
    if not isinstance(ref, ray.ObjectRef):
        raise TypeError(f"rd.broadcast takes an ObjectRef, got {type(ref).__name__}")
    actors = list(actors)
    if not all(isinstance(a, ActorHandle) for a in actors):
        raise TypeError("rd.broadcast delivers to actors: pass a list of actor handles")
    [value] = get_deferred([ref], timeout)
    direct = isinstance(value, PendingFetch) and isinstance(value.payload, Payload)
    if not direct or len(actors) < 2:  # an inline value came with the ref itself
        return [ref] * len(actors)  # nothing to share: every reader reads as usual
    nodes = _nodes_of(actors, timeout)
    by_node: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        by_node.setdefault(node, []).append(i)
    refs: list[ray.ObjectRef] = [ref] * len(actors)
    for node, members in by_node.items():
        if len(members) < 2:
            continue
        relay_ref = _ray.run_in_actor(actors[members[0]], _relay, [ref], timeout)
        for i in members:
            refs[i] = relay_ref
        log.debug(
            "raydirect: broadcast relays %d readers on node %s through one read", len(members), node
        )
    return refs
