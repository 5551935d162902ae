"""Group state: this process's memberships in collective groups (gloo, nccl).

Each group is a standalone torch.distributed process group, made by
``_group_api`` in every member. This module holds what the two-sided
transports need during a transfer: the group by name, its rank and members,
a tag per transfer, per-pair locks, and whether it is broken. Marking a group
broken tells the other members through their agents (``_channel``).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from raydirect import _channel, _wire
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
_lock = threading.Lock()


def local_group(name: str) -> Group | None:
    with _lock:
        return _groups.get(name)


def local_groups(backend: str) -> dict[str, Group]:
    with _lock:
        return {n: g for n, g in _groups.items() if g.backend == backend}


def in_live_group(backend: str) -> bool:
    """Is this process in a usable group of ``backend``?"""
    return any(not g.broken for g in local_groups(backend).values())


def add(group: Group) -> Group | None:
    """Record ``group``; returns the stale group it replaces under that name, if any."""
    with _lock:
        stale = _groups.pop(group.name, None)
        _groups[group.name] = group
    return stale


def remove(name: str, generation: str | None = None) -> Group | None:
    """Forget group ``name`` (only that generation, when given); the group removed."""
    with _lock:
        group = _groups.get(name)
        if group is None or (generation is not None and group.generation != generation):
            return None
        return _groups.pop(name)


def shutdown(group: Group) -> None:
    """Tear the process group down, best effort: it is going away."""
    for method in ("abort", "shutdown"):
        try:
            getattr(group.process_group, method)()
            return
        except Exception:  # noqa: PERF203
            continue


def mark_broken(group: Group, reason: str, tell_others: bool = True) -> None:
    """Fail this member's pending and later transfers in ``group``; tell the others."""
    if group.broken:
        return
    group.broken = reason
    log.error("raydirect: collective group %r is broken: %s", group.name, reason)
    shutdown(group)
    if not tell_others:
        return
    for member in group.members:
        if member.rank == group.rank:
            continue
        try:
            _channel.notify(
                member.agent_address,
                {
                    "op": _wire.GROUP_BROKEN,
                    "group": group.name,
                    "generation": group.generation,
                    "token": group.token.hex(),
                    "reason": reason,
                },
            )
        except Exception:  # the member may be the one that died
            log.debug("raydirect: could not tell rank %d", member.rank, exc_info=True)


def _forget_after_fork() -> None:
    # A forked child is in no group: the process groups and their rank are the parent's.
    global _groups, _lock
    _groups, _lock = {}, threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
