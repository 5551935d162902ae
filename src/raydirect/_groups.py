"""Collective groups over actors, for the two-sided transports (gloo, nccl).

Each group is a standalone torch.distributed process group in every member,
rendezvoused through a TCPStore hosted by the first member under a prefix of
its own, so one actor can be in several groups and the default world is never
touched. Every creation gets a fresh *generation*: a group destroyed and made
again under the same name is a different group, and objects exported under the
old one fall back to another transport instead of talking to a dead group.

Setup and teardown run through ``actor.__ray_call__`` (waiting for a busy
member's current task is acceptable at setup); marking a group broken and
destroying it go through the members' agents, which answer even while the
actor is busy, authenticated by the group's token.
"""

from __future__ import annotations

import datetime
import hmac
import json
import logging
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from raydirect import _agent, _ray
from raydirect.errors import GroupError

log = logging.getLogger("raydirect")

BACKENDS = ("gloo", "nccl")
# Bounds a member that never answers: Gloo's default is 30 minutes.
DEFAULT_TIMEOUT_S = 60.0


@dataclass
class Member:
    rank: int
    actor_id: str
    agent_address: str
    node_id: str


@dataclass
class Group:
    """This process's membership in one group."""

    name: str
    generation: str
    backend: str
    rank: int
    world: int
    token: bytes
    process_group: Any
    members: list[Member] = field(default_factory=list)
    broken: str | None = None
    store: Any = None  # keeps the rendezvous store alive (the host's is the server)
    pair_locks: dict[int, threading.Lock] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _tags: int = 0

    def next_tag(self) -> int:
        """A tag for one transfer, unique among this member's receives."""
        with self._lock:
            self._tags = (self._tags + 1) % (1 << 24)
            return (self.rank << 24 | self._tags) & 0x7FFFFFFF

    def pair_lock(self, peer: int) -> threading.Lock:
        """Serialises transfers between this member and ``peer`` (NCCL ignores tags)."""
        with self._lock:
            return self.pair_locks.setdefault(peer, threading.Lock())

    def check_usable(self) -> None:
        if self.broken:
            raise GroupError(
                f"collective group {self.name!r} is broken ({self.broken}); destroy it with "
                f"rd.destroy_collective_group({self.name!r}) and create it again"
            )


_groups: dict[str, Group] = {}
_hosted_stores: dict[str, Any] = {}
_lock = threading.Lock()


def local_group(name: str) -> Group | None:
    with _lock:
        return _groups.get(name)


def local_groups(backend: str) -> dict[str, Group]:
    with _lock:
        return {n: g for n, g in _groups.items() if g.backend == backend}


# ------------------------------------------------------------ run in members


def _host_store(_self: Any, name: str, generation: str) -> tuple[str, int]:
    from torch.distributed import TCPStore

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
    from torch.distributed import PrefixStore, TCPStore

    from raydirect.transports.registry import transport_class

    with _lock:
        # The name is free cluster-wide (create checked): an entry here is stale.
        stale = _groups.pop(name, None)
        store = _hosted_stores.pop(f"{name}/{generation}", None)
    if stale is not None:
        _shutdown(stale)
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = TCPStore(host, port, is_master=False, timeout=timeout)
    prefixed = PrefixStore(f"raydirect/{name}/{generation}", store)
    make = transport_class(backend).make_process_group  # type: ignore[attr-defined]
    process_group = make(prefixed, rank, world, timeout)
    group = Group(name, generation, backend, rank, world, token, process_group, store=store)
    with _lock:
        _groups[name] = group
    server = _agent.agent()
    return {
        "rank": rank,
        "actor_id": _ray.current_actor_id() or "",
        "agent_address": server.address,
        "node_id": _ray.node_id(),
    }


def _set_members(_self: Any, name: str, generation: str, members: list[dict[str, Any]]) -> None:
    group = local_group(name)
    if group is not None and group.generation == generation:
        group.members = [Member(**m) for m in members]


def _leave(_self: Any, name: str, generation: str | None = None) -> bool:
    with _lock:
        group = _groups.get(name)
        if group is None or (generation is not None and group.generation != generation):
            _hosted_stores.pop(f"{name}/{generation}", None)
            return False
        del _groups[name]
    _shutdown(group)
    return True


def _shutdown(group: Group) -> None:
    for method in ("abort", "shutdown"):
        try:
            getattr(group.process_group, method)()
            return
        except Exception:  # noqa: PERF203 - best effort: the group is going away
            continue


def handle_control(request: dict[str, Any]) -> dict[str, Any]:
    """Agent requests about groups: ``group_broken`` and ``group_leave``,
    authenticated by the group's token."""
    name, generation = request.get("group"), request.get("generation")
    group = local_group(str(name))
    if group is None or group.generation != generation:
        return {"ok": True, "known": False}
    if not hmac.compare_digest(group.token, bytes.fromhex(str(request.get("token", "")))):
        return {"ok": False, "kind": "bad_request", "error": "wrong group token"}
    if request["op"] == "group_broken":
        mark_broken(
            group, str(request.get("reason", "a member reported a failure")), tell_others=False
        )
    else:
        _leave(None, group.name, group.generation)
    return {"ok": True, "known": True}


def mark_broken(group: Group, reason: str, tell_others: bool = True) -> None:
    """Fail this member's pending and later transfers in ``group``; tell the others."""
    if group.broken:
        return
    group.broken = reason
    log.error("raydirect: collective group %r is broken: %s", group.name, reason)
    _shutdown(group)
    if not tell_others:
        return
    for member in group.members:
        if member.rank == group.rank:
            continue
        try:
            _agent.notify(
                member.agent_address,
                {
                    "op": "group_broken",
                    "group": group.name,
                    "generation": group.generation,
                    "token": group.token.hex(),
                    "reason": reason,
                },
            )
        except Exception:  # the member may be the one that died
            log.debug("raydirect: could not tell rank %d", member.rank, exc_info=True)


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
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown collective backend {backend!r}; use one of {BACKENDS}")
    actors = list(actors)
    if len(actors) < 2 or not all(isinstance(a, ray.actor.ActorHandle) for a in actors):
        raise ValueError("create_collective_group needs a list of two or more actor handles")
    ids = [_ray.actor_id_of(a) for a in actors]
    if len(set(ids)) != len(ids):
        raise ValueError("an actor appears twice in the group")
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
            actors[0].__ray_call__.remote(_host_store, name, generation), timeout=timeout
        )
        infos = ray.get(
            [
                actor.__ray_call__.remote(
                    _join, name, generation, backend, rank, world, host, port, token, timeout
                )
                for rank, actor in enumerate(actors)
            ],
            timeout=timeout + 30,
        )
        ray.get(
            [a.__ray_call__.remote(_set_members, name, generation, infos) for a in actors],
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


def _leave_all(actors: Sequence[Any], name: str, generation: str) -> None:
    refs = [a.__ray_call__.remote(_leave, name, generation) for a in actors]
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
                _agent.request(
                    member["agent_address"],
                    {
                        "op": "group_leave",
                        "group": name,
                        "generation": record["generation"],
                        "token": record["token"],
                    },
                    timeout=10.0,
                )
            except Exception:  # a dead member has nothing left to leave
                log.debug("raydirect: rank %s unreachable at destroy", member["rank"])
        _ray.delete_group_record(name)
