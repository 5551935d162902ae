"""The only module that touches Ray internals.

Everything Ray does not offer publicly goes through here, so a Ray upgrade
that moves an internal breaks one file. Public Ray API is used directly
elsewhere.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import threading
from collections.abc import Callable
from typing import Any

import ray


def add_out_of_scope_callback(ref: ray.ObjectRef, callback: Callable[[bytes], None]) -> bool:
    """Run ``callback(id_bytes)`` once no reference to ``ref`` exists anywhere.

    Works only in the process that owns ``ref``. Ray runs the callback on a
    non-main thread about a millisecond after the last reference (local,
    borrowed, nested, or held by a pending task) is gone. Returns False when
    the object is already out of scope (the callback will not run).
    """
    from ray._private.worker import global_worker

    core_worker = global_worker.core_worker  # type: ignore[attr-defined]
    return bool(core_worker.add_object_out_of_scope_callback(ref, callback))


def session_key() -> tuple[int, str]:
    """Changes when this process forks or connects to another Ray session; state
    tied to one session (leases, node identity) is dropped when it changes."""
    from ray._private.worker import global_worker

    node = getattr(global_worker, "node", None)
    return os.getpid(), getattr(node, "session_name", "") or ""


@functools.lru_cache(maxsize=4)
def _node_identity(key: tuple[int, str]) -> tuple[str, str]:
    ctx = ray.get_runtime_context()
    return ctx.get_node_id(), ray.util.get_node_ip_address()


def node_id() -> str:
    """The Ray node id of this process."""
    return _node_identity(session_key())[0]


def node_ip() -> str:
    """The address Ray uses for this node: what the agent binds to."""
    return _node_identity(session_key())[1]


def ensure_ray() -> None:
    """Connect to Ray the way ``ray.put`` would, if this process is not connected yet."""
    if not ray.is_initialized():
        init_ray()


def init_ray(**kwargs: Any) -> Any:
    """``ray.init(**kwargs)``, safe in a process that seeded Python's ``random``.

    Ray 2.60 draws a driver's GCS subscriber ids from the ``random`` module. Two
    drivers that seeded it alike (vLLM seeds every worker with the model's seed)
    then subscribe under one id and end each other's long polls: both spin, and
    so does the GCS (measured: two such drivers 16% of a core each and the GCS
    46%, against 0.2% and 0.4% unseeded). The connect draws from fresh entropy
    and the caller's stream is put back as it was, so its determinism holds."""
    state = random.getstate()
    random.seed()  # os.urandom
    try:
        return ray.init(**kwargs)
    finally:
        random.setstate(state)


def current_task_label() -> str:
    """A short human name of what runs here, for error messages: ``Class.method``,
    ``task_name``, or ``driver``."""
    from ray._private.worker import global_worker

    if global_worker.mode != ray.WORKER_MODE:  # Ray logs a warning if a driver asks
        return "driver"
    return ray.get_runtime_context().get_task_name() or "driver"


def current_actor_id() -> str | None:
    return ray.get_runtime_context().get_actor_id()


# Agents announce themselves in Ray's internal key-value store so that
# ``raydirect status`` can find every process holding objects.
_AGENT_KEY_PREFIX = b"raydirect/agent/"


def publish_agent(key: str, info: bytes) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(_AGENT_KEY_PREFIX + key.encode(), info, overwrite=True)


# How long a call made while the process exits may wait on the GCS. Ray's GCS
# client waits up to 60 s (``gcs_rpc_server_reconnect_timeout_s``) for a GCS that
# is gone to come back, and a process whose cluster was shut down under it
# (its parent pid now 1) would sit that long in an exit hook, holding its memory.
EXIT_TIMEOUT_S = 1.0


def withdraw_agent(key: str, timeout: float | None = None) -> None:
    """Remove an agent's announcement; waits at most ``timeout`` seconds on the
    GCS (``ray.exceptions.RpcError`` past it). Nothing to do when this process is
    no longer connected (``ray.shutdown()`` ran)."""
    from ray.experimental import internal_kv

    client = internal_kv.internal_kv_get_gcs_client()
    if client is not None:
        client.internal_kv_del(_AGENT_KEY_PREFIX + key.encode(), False, None, timeout=timeout)


def actor_process(actor_id: str) -> tuple[str, int] | None:
    """``(state, pid)`` of an actor in Ray's actor table (state ``ALIVE``,
    ``RESTARTING``, ``DEAD``, ...); None when Ray does not know the actor."""
    from ray._private import state

    info = state.actors(actor_id)
    if not info:
        return None
    return str(info["State"]), int(info["Pid"])


def published_agents() -> dict[str, bytes]:
    from ray.experimental import internal_kv

    keys = internal_kv._internal_kv_list(_AGENT_KEY_PREFIX) or []
    out = {}
    for key in keys:
        value = internal_kv._internal_kv_get(key)
        if value is not None:
            out[key[len(_AGENT_KEY_PREFIX) :].decode()] = value
    return out


# Collective groups are recorded cluster-wide so that any process can find and
# destroy them by name.
_GROUP_KEY_PREFIX = b"raydirect/group/"


def put_group_record(name: str, record: bytes) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(_GROUP_KEY_PREFIX + name.encode(), record, overwrite=True)


def group_record(name: str) -> bytes | None:
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(_GROUP_KEY_PREFIX + name.encode())


def group_records() -> dict[str, bytes]:
    from ray.experimental import internal_kv

    out = {}
    for key in internal_kv._internal_kv_list(_GROUP_KEY_PREFIX) or []:
        value = internal_kv._internal_kv_get(key)
        if value is not None:
            out[key[len(_GROUP_KEY_PREFIX) :].decode()] = value
    return out


def delete_group_record(name: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(_GROUP_KEY_PREFIX + name.encode())


def actor_id_of(handle: ray.actor.ActorHandle) -> str:
    return handle._actor_id.hex()


# Transports registered at run time travel to every process through here.
_TRANSPORT_KEY_PREFIX = b"raydirect/transport/"


def put_transport_record(name: str, blob: bytes) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(_TRANSPORT_KEY_PREFIX + name.encode(), blob, overwrite=True)


def transport_record(name: str) -> bytes | None:
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(_TRANSPORT_KEY_PREFIX + name.encode())


def transport_records() -> list[str]:
    from ray.experimental import internal_kv

    keys = internal_kv._internal_kv_list(_TRANSPORT_KEY_PREFIX) or []
    return [k[len(_TRANSPORT_KEY_PREFIX) :].decode() for k in keys]


# The root of ``rd.cluster_secret`` where Ray's token authentication is off.
_SECRET_KEY = b"raydirect/secret/v1"
_SECRET_TRIES = 3


def cluster_random_key(new: bytes) -> bytes:
    """The cluster's random key in Ray's internal KV store: ``new`` is stored
    unless a key is already (the first process to ask makes it), then the stored
    one is read back, so every process gets the same. ``RuntimeError`` when the
    store keeps losing it."""
    from ray.experimental import internal_kv

    for _ in range(_SECRET_TRIES):  # deleted between the put and the get: put again
        internal_kv._internal_kv_put(_SECRET_KEY, new, overwrite=False)
        stored = internal_kv._internal_kv_get(_SECRET_KEY)
        if stored:
            return bytes(stored)
    raise RuntimeError(f"Ray's internal KV store did not keep {_SECRET_KEY.decode()!r}")


def current_actor_handle() -> ray.actor.ActorHandle | None:
    """This process's own actor handle; None in a driver or a task."""
    try:
        return ray.get_runtime_context().current_actor
    except Exception:  # not an actor
        return None


def _none_each(actor: Any, n: int) -> list[None]:
    return [None] * n


def mint_own_refs(handle: ray.actor.ActorHandle, n: int) -> list[ray.ObjectRef]:
    """``n`` refs owned by this actor, minted as the returns of one task it sends
    itself (``__ray_call__``, Ray's hook for running a function on an actor).
    Small returns live in this process's memory store: no plasma object, no
    raylet pin, unlike ``ray.put``. Blocks until the task has run, which a busy
    single-threaded actor delays; raises what ``.remote()`` raises (a
    ``max_pending_calls`` limit reached)."""
    refs = mint_refs_on(handle, _none_each, n, n=n)
    ray.wait(refs, num_returns=n, fetch_local=False)
    return refs


def mint_refs_on(
    handle: ray.actor.ActorHandle, fn: Callable[..., list[Any]], *args: Any, n: int
) -> list[ray.ObjectRef]:
    """``n`` refs owned by this process, the returns of ``fn(actor_instance, *args)``
    run as one task of ``handle``'s actor; not waited for (a pending ref nests in
    an argument or a value as well as a ready one). Raises what ``.remote()``
    raises (a ``max_pending_calls`` limit reached)."""
    refs: list[ray.ObjectRef] = handle.__ray_call__.options(num_returns=n).remote(fn, *args)
    return list(refs)


def max_pending_calls(handle: ray.actor.ActorHandle) -> int:
    """The actor's ``max_pending_calls`` limit on this process's calls (-1: none),
    read from the handle Ray serializes: Ray keeps it only on its C++ side."""
    from ray._private.worker import global_worker
    from ray.core.generated import core_worker_pb2

    state = global_worker.core_worker.serialize_actor_handle(handle._actor_id)  # type: ignore[attr-defined]
    proto = core_worker_pb2.ActorHandle()  # type: ignore[attr-defined]
    proto.ParseFromString(state[0])
    return int(proto.max_pending_calls)


def on_ready(ref: ray.ObjectRef, callback: Callable[[BaseException | None], None]) -> None:
    """Run ``callback(None)`` on a Ray thread once ``ref``'s object exists (its
    task has run), or ``callback(error)`` when Ray cannot tell; at once when it
    exists already. Fetches nothing and holds no reference: ``ref``'s object is
    freed as if nobody waited (Ray 2.60's private ``ObjectRef._on_ready``;
    tests/test_caller_leases.py fails if an upgrade drops it)."""
    ref._on_ready(callback)


def set_invocation_decorator(
    method: Any, decorator: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    """Have Ray wrap each call of ``method`` made through an actor handle, in the
    calling process (whichever: a handle passed by pickling too), as
    ``decorator(invocation)(args, kwargs)``; ``invocation`` submits the call.
    Ray's private hook, read from the method when its class is made remote
    (tests/test_caller_leases.py fails if an upgrade drops it)."""
    method.__ray_invocation_decorator__ = decorator


def actor_of_invocation(invocation: Callable[..., Any]) -> ray.actor.ActorHandle | None:
    """The actor a call handed to an invocation decorator goes to: Ray 2.60's
    ``invocation`` closes over its ``ActorMethod`` as ``self``. None where that
    changed (the caller then passes no lease of its own)."""
    try:
        cell = invocation.__closure__[invocation.__code__.co_freevars.index("self")]  # type: ignore[index]
        actor = cell.cell_contents._actor
    except (AttributeError, IndexError, ValueError, TypeError):
        return None
    return actor if isinstance(actor, ray.actor.ActorHandle) else None


def declared_num_returns(method: Any) -> Any:
    """What ``@ray.method(num_returns=...)`` declared on ``method`` (1 if nothing);
    Ray stores it as a private attribute, read at call time."""
    return getattr(method, "__ray_num_returns__", 1)


def run_in_actor(actor: ray.actor.ActorHandle, fn: Callable[..., Any], *args: Any) -> ray.ObjectRef:
    """Run ``fn(actor_instance, *args)`` as a task of ``actor``, which need not
    define a method for it (Ray's developer API ``__ray_call__``)."""
    return actor.__ray_call__.remote(fn, *args)


class _OffLoopGetFilter:
    """Drops Ray's "blocking ray.get inside async actor" warning for gets that
    ``rd.get_async`` runs on its own threads, where they block no event loop."""

    def filter(self, record: Any) -> bool:
        return not (
            threading.current_thread().name.startswith(OFF_LOOP_THREAD_PREFIX)
            and str(record.msg).startswith("Using blocking ray.get inside async actor")
        )


OFF_LOOP_THREAD_PREFIX = "raydirect-async"


@functools.cache
def quiet_off_loop_get_warning() -> None:
    logging.getLogger("ray._private.worker").addFilter(_OffLoopGetFilter())


# Ray 2.60 token authentication (RAY_AUTH_MODE=token; the default for a local
# ``ray.init()``). The token comes from RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH
# names, or ~/.ray/auth_token; Ray's own loader knows the order, so ask it.
def cluster_auth_token() -> bytes | None:
    """The Ray cluster's auth token when token authentication is on, else None."""
    from ray import _raylet

    if _raylet.get_authentication_mode() != _raylet.AuthenticationMode.TOKEN:  # type: ignore[attr-defined]
        return None
    loader = _raylet.AuthenticationTokenLoader.instance()  # type: ignore[attr-defined]
    if not loader.has_token():
        return None
    token = loader.get_raw_token()
    return token.encode() if isinstance(token, str) else bytes(token)


def tls_enabled() -> bool:
    """Is Ray's gRPC TLS configured for this process (RAY_USE_TLS)?"""
    return os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")


# A process forked from one connected to Ray inherits the connection's state
# but not its threads: Ray cannot be used there, and a read would hang.
_connected_at_fork = False
_forked_from: int | None = None


def _note_connection() -> None:
    global _connected_at_fork
    _connected_at_fork = ray.is_initialized()


def _in_forked_child() -> None:
    global _forked_from
    if _connected_at_fork:
        _forked_from = os.getppid()


os.register_at_fork(before=_note_connection, after_in_child=_in_forked_child)


def forked_from() -> int | None:
    """The parent's pid when this process was forked from one connected to Ray, else None."""
    return _forked_from
