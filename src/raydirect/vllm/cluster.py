"""Which Ray cluster an engine's workers talk to, and whom they trust in it.

The trust boundary is the engine's own Ray cluster: whoever can create actors in
it can already run code on its nodes. A request to the engine (vLLM's RPC, or
its HTTP RL routes, which anyone who reaches the server may call) carries only
JSON: a mailbox's name, and the trainer's cluster and namespace for checking.
So a worker

* joins the cluster of its own environment, never one a request names: its Ray
  actor's under vLLM's Ray executor, else ``RAY_ADDRESS`` (or the cluster
  running on this node), with the namespace of ``RAY_NAMESPACE``; the plug-in
  passes the Ray context of a process hosting the engine (an ``LLM`` in a Ray
  actor) on to the processes vLLM starts, through those two variables;
* refuses, before it connects to anything, a trainer outside that cluster (its
  node is none of the cluster's nodes) or in another namespace;
* talks only to an actor of raydirect's ``RaydirectMailbox`` class under the
  given name: nothing a request carries makes it unpickle another actor's reply
  (an actor of that class name can only be made by a member of the cluster,
  who is trusted anyway).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import ray

import raydirect as rd

ADDRESS, NAMESPACE = "RAY_ADDRESS", "RAY_NAMESPACE"
# The Ray node of the process hosting the engine, for the processes vLLM starts.
# Without it a worker's ray.init joins the node whose raylet it finds in the
# host's process table, the head's first: where several Ray nodes share one
# (containers with the host's PID namespace, network namespaces) that is another
# node's address, which the worker's agent then cannot bind.
NODE_IP = "RAYDIRECT_NODE_IP"
_MAILBOX = "RaydirectMailbox"  # the class a trainer's mailbox actor is made of (mailbox.py)


@dataclass(frozen=True)
class Trainer:
    """Where a trainer said its mailbox is (the init info's fields)."""

    name: str
    namespace: str
    address: str
    node: str

    @classmethod
    def of(cls, fields: dict[str, Any]) -> Trainer:
        try:
            return cls(*(str(fields[k]) for k in ("name", "namespace", "address", "node")))
        except KeyError as exc:
            raise rd.WeightSyncError(
                f"raydirect: the init info lacks {exc}: the trainer's raydirect is older "
                "than the engine's; install the same raydirect on both"
            ) from None


_exported: dict[str, str] = {}  # what export_ray_context set, by variable


def export_ray_context() -> None:
    """In a process connected to Ray (e.g. an ``LLM`` inside a Ray actor): makes
    the processes it starts (vLLM's engine core and workers) join the same
    cluster and namespace, as processes of its node. A cluster or namespace the
    user set is kept; one this function set follows the process's current Ray
    connection (it may have reconnected). The node is always this process's: a
    value inherited from a process on another node (a driver that started this
    one) would make the workers join as that node's processes, and fail."""
    if not ray.is_initialized():
        return
    context = ray.get_runtime_context()
    for name, value in ((ADDRESS, context.gcs_address), (NAMESPACE, context.namespace)):
        if os.environ.get(name) in (None, "", _exported.get(name)):
            os.environ[name] = _exported[name] = value
    os.environ[NODE_IP] = ray.util.get_node_ip_address()


def join(trainer: Trainer) -> str:
    """Joins this engine's own Ray cluster (once per process) and checks that
    ``trainer`` is in it; returns the namespace to look the mailbox up in.
    Raises ``rd.WeightSyncError`` naming the fix otherwise."""
    own = os.environ.get(NAMESPACE) or None
    if ray.is_initialized():
        own = own or ray.get_runtime_context().namespace
    else:
        _connect(own, trainer)
    if own is not None and own != trainer.namespace:
        raise rd.WeightSyncError(
            f"raydirect: the trainer's mailbox is in Ray namespace {trainer.namespace!r}, "
            f"this engine's is {own!r}: start the trainer in the engine's namespace, or "
            f"the engine with {NAMESPACE}={trainer.namespace}"
        )
    nodes = {n.get("NodeID") for n in ray.nodes()}
    if trainer.node not in nodes:
        here = ray.get_runtime_context().gcs_address
        raise rd.WeightSyncError(
            f"raydirect: the trainer is not in this engine's Ray cluster (it names the "
            f"cluster at {trainer.address}; this engine's is at {here}). An engine joins "
            f"the cluster of its own environment ({ADDRESS}, or its Ray actor's), never "
            "one a request names: start the engine in the trainer's cluster"
        )
    return own or trainer.namespace


def _connect(namespace: str | None, trainer: Trainer) -> None:
    _init(
        namespace,
        rd.WeightSyncError,
        f"Start it with {ADDRESS} set to the trainer's cluster (the trainer's is at "
        f"{trainer.address})",
    )


def join_own() -> None:
    """Joins this engine's own Ray cluster (once per process), with no trainer:
    what the KV connector's workers do before they export or read a region.
    ``RuntimeError`` naming the fix if there is none."""
    if ray.is_initialized():
        return
    _init(
        os.environ.get(NAMESPACE) or None,
        RuntimeError,
        f"Start a Ray cluster on this node (ray start --head), or set {ADDRESS} to the "
        "cluster's address; prefill and decode engines must be in the same cluster",
    )


def _init(namespace: str | None, error: type[Exception], fix: str) -> None:
    """Joins the cluster of this process's environment; ``error`` with ``fix`` if none."""
    node: dict[str, Any] = {}
    if os.environ.get(NODE_IP):  # the node of the process hosting the engine
        node["_node_ip_address"] = os.environ[NODE_IP]
    try:
        rd.init_ray(  # vLLM seeded ``random`` alike in every worker
            address=os.environ.get(ADDRESS) or "auto",
            namespace=namespace,
            logging_level=logging.WARNING,
            log_to_driver=False,
            **node,
        )
    except ConnectionError as exc:
        raise error(
            f"raydirect: this engine is in no Ray cluster ({ADDRESS}="
            f"{os.environ.get(ADDRESS, '')!r}: {exc}). {fix}"
        ) from None


def mailbox(trainer: Trainer, namespace: str) -> Any:
    """The trainer's mailbox actor, checked to be one before any call to it."""
    try:
        actor = ray.get_actor(trainer.name, namespace=namespace)
    except ValueError:
        raise rd.WeightSyncError(
            f"raydirect: no trainer mailbox {trainer.name!r} in Ray namespace "
            f"{namespace!r}: is the trainer's trainer_init running?"
        ) from None
    # An actor handle's repr names the class it was made of ("Actor(Class, id)");
    # reading it makes no call, so an impostor's reply is never unpickled.
    if not repr(actor).startswith(f"Actor({_MAILBOX},"):
        raise rd.WeightSyncError(
            f"raydirect: the actor named {trainer.name!r} in namespace {namespace!r} is "
            f"{repr(actor)}, not a raydirect trainer mailbox: refused (name the trainer's "
            "mailbox, RaydirectTrainerInitInfo.name)"
        )
    return actor
