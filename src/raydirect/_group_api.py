"""Collective groups over actors, for the two-sided transports (gloo, nccl): the API.

Each group is a standalone torch.distributed process group in every member,
rendezvoused through a TCPStore hosted by the first member under a prefix of
its own, so one actor can be in several groups and the default world is never
touched. Every creation gets a fresh *generation*: a group destroyed and made
again under the same name is a different group, and objects exported under the
old one fall back to another transport instead of talking to a dead group.

Setup and teardown run in the members as Ray tasks (``_ray.run_in_actor``;
waiting for a busy member's current task is acceptable at setup); marking a
group broken and destroying it go through the members' agents, which answer
even while the actor is busy, authenticated by the group's token. What a
member holds during transfers is in ``_groups`` (group state).
"""

from __future__ import annotations

import datetime
import hmac
import json
import logging
import os
import secrets
import threading
from collections.abc import Sequence
from typing import Any

import ray
from torch.distributed import PrefixStore, TCPStore

from raydirect import _channel, _groups, _ray, _runtime, _server, _wire
from raydirect._groups import DEFAULT_TIMEOUT_S, Group, Member
from raydirect._server import CONTROL, Reply
from raydirect.transports.registry import transport_class

log = logging.getLogger("raydirect")

_hosted_stores: dict[str, Any] = {}
_lock = threading.Lock()


# ------------------------------------------------------------ run in members


def _host_store(_self: Any, name: str, generation: str) -> tuple[str, int]:
    ip = _ray.node_ip()
    store = TCPStore(
        ip,
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S),
    )
    with _lock:
        _hosted_stores[f"{name}/{generation}"] = store
    return ip, store.port


def _join(
    _self: Any,
    name: str,
    generation: str,
    backend: str,
    rank: int,
    world: int,
    host: str,
    port: int,
    token: bytes,
    timeout_s: float,
) -> dict[str, Any]:
    with _lock:
        store = _hosted_stores.pop(f"{name}/{generation}", None)
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = TCPStore(host, port, is_master=False, timeout=timeout)
    prefixed = PrefixStore(f"raydirect/{name}/{generation}", store)
    make = transport_class(backend).make_process_group  # type: ignore[attr-defined]
    process_group = make(prefixed, rank, world, timeout, _ray.node_ip())
    group = Group(name, generation, backend, rank, world, token, process_group, store=store)
    # The name is free cluster-wide (create checked): a group it replaces is stale.
    stale = _groups.add(group)
    if stale is not None:
        _groups.shutdown(stale)
    return {
        "rank": rank,
        "actor_id": _ray.current_actor_id() or "",
        "agent_address": _runtime.agent().address,
        "node_id": _ray.node_id(),
    }


def _set_members(_self: Any, name: str, generation: str, members: list[dict[str, Any]]) -> None:
    group = _groups.local_group(name)
    if group is not None and group.generation == generation:
        group.members = [Member(**m) for m in members]


def _leave(_self: Any, name: str, generation: str | None = None) -> bool:
    group = _groups.remove(name, generation)
    if group is None:
        with _lock:
            _hosted_stores.pop(f"{name}/{generation}", None)
        return False
    _groups.shutdown(group)
    return True


def _serve_group_op(request: dict[str, Any], reply: Reply) -> None:
    """``group_broken`` and ``group_leave``, authenticated by the group's token."""
    answer = _group_op(request)
    if request.get("reply"):
        reply.send(answer)


def _group_op(request: dict[str, Any]) -> dict[str, Any]:
    name, generation = request.get("group"), request.get("generation")
    group = _groups.local_group(str(name))
    if group is None or group.generation != generation:
        return {"ok": True, "known": False}
    if not hmac.compare_digest(group.token, bytes.fromhex(str(request.get("token", "")))):
        return _wire.refusal(_wire.BAD_REQUEST, "wrong group token")
    if request["op"] == _wire.GROUP_BROKEN:
        reason = str(request.get("reason", "a member reported a failure"))
        _groups.mark_broken(group, reason, tell_others=False)
    else:
        _leave(None, group.name, group.generation)
    return {"ok": True, "known": True}


_server.register(_wire.GROUP_BROKEN, _serve_group_op, needs_object=False, lane=CONTROL)
_server.register(_wire.GROUP_LEAVE, _serve_group_op, needs_object=False, lane=CONTROL)


# ------------------------------------------------------------ public API
def create_collective_group(
    actors: Sequence[Any],
    backend: str,
    name: str | None = None,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> str:
    """Make ``actors`` a collective group for the ``gloo`` or ``nccl`` transport.

    Callable from any process. Rank i is ``actors[i]``; the first hosts the
    rendezvous store. An actor may be in several groups (under different
    names). Returns the group's name. ``timeout`` bounds the setup and every
    later transfer that would otherwise wait on a silent member.

    A group of one actor is a group, as in Ray: its member may then return
    objects for the group's transport. It reads them itself as the very
    tensors it returned (same process, no copy), and every other process reads
    them over ``tcp``, the fallback for non-members.
    """
    actors = _checked(actors, backend)
    name = name or f"group-{secrets.token_hex(4)}"
    if _ray.group_record(name) is not None:
        raise ValueError(
            f"a collective group named {name!r} exists; destroy it first with "
            f"rd.destroy_collective_group({name!r}) or pick another name"
        )
    generation = secrets.token_hex(8)
    token = secrets.token_bytes(16)
    world = len(actors)
    try:
        host, port = ray.get(
            _ray.run_in_actor(actors[0], _host_store, name, generation), timeout=timeout
        )
        joins = [
            _ray.run_in_actor(
                actor, _join, name, generation, backend, rank, world, host, port, token, timeout
            )
            for rank, actor in enumerate(actors)
        ]
        infos = ray.get(joins, timeout=timeout + 30)
        ray.get(
            [_ray.run_in_actor(a, _set_members, name, generation, infos) for a in actors],
            timeout=timeout,
        )
    except BaseException:
        _leave_all(actors, name, generation)
        raise
    _ray.put_group_record(
        name,
        json.dumps(
            {"generation": generation, "backend": backend, "token": token.hex(), "members": infos}
        ).encode(),
    )
    return name


def _checked(actors: Sequence[Any], backend: str) -> list[Any]:
    """``actors`` as a list, once they can form a group of ``backend``."""
    if backend not in _groups.BACKENDS:
        raise ValueError(f"unknown collective backend {backend!r}; use one of {_groups.BACKENDS}")
    actors = list(actors)
    if not actors or not all(isinstance(a, ray.actor.ActorHandle) for a in actors):
        raise ValueError(
            "create_collective_group needs a list of one or more actor handles "
            "(ActorClass.remote() results)"
        )
    ids = [_ray.actor_id_of(a) for a in actors]
    if len(set(ids)) != len(ids):
        raise ValueError("an actor appears twice in the group")
    return actors


def _leave_all(actors: Sequence[Any], name: str, generation: str) -> None:
    refs = [_ray.run_in_actor(a, _leave, name, generation) for a in actors]
    try:
        ray.get(refs, timeout=30)
    except Exception:  # a member that died has nothing left to leave
        log.debug("raydirect: leaving group %r after a failed setup", name, exc_info=True)


def destroy_collective_group(name_or_actors: str | Sequence[Any]) -> None:
    """Destroy a group by name, or every group whose members are exactly these actors.

    Members are told through their agents, so a member busy in a long task
    still leaves at once; a dead member is skipped. The name can be used again.
    """
    if isinstance(name_or_actors, str):
        names = [name_or_actors]
    else:
        wanted = {_ray.actor_id_of(a) for a in list(name_or_actors)}
        names = [
            n
            for n, rec in _ray.group_records().items()
            if {m["actor_id"] for m in json.loads(rec)["members"]} == wanted
        ]
        if not names:
            raise ValueError("these actors form no collective group")
    for name in names:
        raw = _ray.group_record(name)
        if raw is None:
            raise ValueError(f"no collective group named {name!r}")
        record = json.loads(raw)
        for member in record["members"]:
            try:
                _channel.request(
                    member["agent_address"],
                    {
                        "op": _wire.GROUP_LEAVE,
                        "group": name,
                        "generation": record["generation"],
                        "token": record["token"],
                    },
                    timeout=10.0,
                )
            except Exception:  # a dead member has nothing left to leave
                log.debug("raydirect: rank %s unreachable at destroy", member["rank"])
        _ray.delete_group_record(name)


def _forget_after_fork() -> None:
    global _hosted_stores, _lock
    _hosted_stores, _lock = {}, threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
