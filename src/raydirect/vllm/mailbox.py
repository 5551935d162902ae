"""Where the trainer's ranks leave each version's handles for the engines' workers.

A named Ray actor, made by trainer rank 0 at ``trainer_init``: the one thing the
JSON-only control plane (vLLM's RPC, HTTP) needs to carry is its name and a
version number. Every rank ``put``s its handle; a worker ``take``s all of them.
Each rank also leaves an *alive token*, an object it owns: Ray loses it when its
owner dies, which is how a waiting side learns that a rank is gone instead of
waiting out its deadline.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray

_POLL = 0.05  # how often a wait looks at the alive tokens
_CHECK = 2.0  # how long one look waits for a token not yet here


async def _fetched(ref: ray.ObjectRef) -> Any:
    return await ref


@ray.remote(num_cpus=0, max_concurrency=64)  # type: ignore[call-overload]
class Mailbox:
    """Versions' handles by rank, the ranks' alive tokens, and each version's outcome."""

    def __init__(self, ranks: int) -> None:
        self._ranks = ranks
        self._handles: dict[int, dict[int, Any]] = {}
        self._failed: dict[int, str] = {}  # version -> why a rank could not publish it
        self._outcomes: dict[int, str] = {}  # version -> "" (applied) or the error
        self._tokens: dict[int, list[ray.ObjectRef]] = {}
        self._last = 0  # the newest version put or ended

    def ranks(self) -> int:
        return self._ranks

    def alive(self, rank: int, token: list[ray.ObjectRef]) -> None:
        """``token``: ``[ref]`` of an object ``rank`` owns (in a list, so Ray keeps
        it a ref instead of resolving it)."""
        self._tokens[rank] = token

    async def dead_ranks(self) -> list[int]:
        """The ranks whose alive token Ray has lost: their process died. (Awaiting
        a token whose owner died raises within moments; a live one's is local
        after its first fetch.)"""
        dead = []
        for rank, (token,) in sorted(self._tokens.items()):
            try:
                await asyncio.wait_for(_fetched(token), _CHECK)
            except asyncio.TimeoutError:
                continue  # not yet fetched from a live owner
            except ray.exceptions.RayError:
                dead.append(rank)
        return dead

    def put(self, version: int, rank: int, handle: list[Any]) -> None:
        self._handles.setdefault(version, {})[rank] = handle[0]
        self._last = max(self._last, version)
        for old in [v for v in self._handles if v < version]:  # a newer one supersedes it
            del self._handles[old]

    def fail(self, version: int, rank: int, why: str) -> None:
        self._failed[version] = f"trainer rank {rank} could not publish version {version}: {why}"

    async def take(self, version: int, timeout: float) -> list[Any]:
        """Every rank's handle of ``version``, in rank order, once all are in.
        Raises (naming the rank) when a rank failed or died, or at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            got = self._handles.get(version, {})
            if len(got) == self._ranks:
                return [got[r] for r in range(self._ranks)]
            if version in self._failed:
                raise RuntimeError(self._failed[version])
            if version < self._last or (version in self._outcomes):
                raise RuntimeError(
                    f"version {version} is gone: the trainer has published a newer one"
                )
            missing = [r for r in range(self._ranks) if r not in got]
            dead = [r for r in await self.dead_ranks() if r in missing]
            if dead:
                raise RuntimeError(
                    f"trainer rank(s) {dead} died before publishing version {version}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"version {version}: no handle from trainer rank(s) {missing} within "
                    f"{timeout:.0f} s (RaydirectTrainerInitInfo.timeout)"
                )
            await asyncio.sleep(_POLL)

    def done(self, version: int, error: str) -> None:
        """Rank 0 says how ``version`` ended: ``""`` applied, else the error."""
        self._outcomes[version] = error
        self._last = max(self._last, version)
        self._handles.pop(version, None)
        for old in [v for v in self._outcomes if v < version - 8]:
            del self._outcomes[old]

    async def outcome(self, version: int, timeout: float) -> str:
        """How ``version`` ended, for the ranks other than 0 (which must keep their
        tensors until the workers have read them)."""
        deadline = time.monotonic() + timeout
        while version not in self._outcomes:
            if 0 in await self.dead_ranks():
                return f"trainer rank 0, which drives the engines, died during version {version}"
            if time.monotonic() > deadline:
                return (
                    f"trainer rank 0 did not finish version {version} within {timeout:.0f} s "
                    "(RaydirectTrainerInitInfo.timeout)"
                )
            await asyncio.sleep(_POLL)
        return self._outcomes[version]
