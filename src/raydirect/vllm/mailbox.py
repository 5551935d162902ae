"""Where a trainer's ranks and the engines' workers meet for each version.

A named Ray actor, made by trainer rank 0 at ``trainer_init``: the JSON-only
control plane (vLLM's RPC, HTTP) then needs to carry only its name and a version
number. For each version:

* every trainer rank ``put``s its handle (or says why it could not: ``fail``);
* every engine worker that takes part ``join``s (synchronously, inside vLLM's
  ``update_weights`` RPC, so once that RPC has returned on every engine rank 0
  knows every worker to wait for), ``take``s the ranks' handles, receives, and
  ``report``s phase one ("received", or why not);
* rank 0 ``decide``s: commit only if every worker received; each worker reads
  the decision in ``finish_weight_update``, loads or drops, and reports phase two;
* rank 0 says how it ended (``done``); the other ranks wait for that (``outcome``).

Each rank also leaves an *alive token*, an object it owns: Ray loses it when its
owner dies, which is how a waiting side learns that a rank is gone instead of
waiting out its deadline. Each engine worker joins with one too: rank 0 learns
within seconds that a worker died in the middle of an update.

Writers never wait behind waiters: writes run in a concurrency group of their
own, and a wait holds no slot while it waits (it sleeps on a future that a write
wakes, however many wait: 256 waiting workers are tested), so a wait costs
nothing until something it waits for changes.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

_WATCH = 0.5  # how often the alive tokens are looked at while someone waits
_CHECK = 2.0  # how long one look waits for a token not yet fetched
_KEPT = 8  # versions whose records are kept after a newer one
WAITS = 100_000  # waits at once: each is a sleeping coroutine, not a thread
# How a worker's phase-two report begins when it loaded nothing (its session
# was closed before rank 0 decided): rank 0 then knows no engine loaded it.
DROPPED = "dropped, not loaded: "


async def _fetched(ref: ray.ObjectRef) -> Any:
    return await ref


class _Changes:
    """Wakes the coroutines waiting for a change. Writes and waits run on the
    event loops of two concurrency groups (two threads): a waiter registers a
    future of its own loop, and a writer resolves it through that loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = set()

    def notify(self) -> None:
        with self._lock:
            waiters, self._waiters = self._waiters, set()
        for loop, future in waiters:
            loop.call_soon_threadsafe(_resolve, future)

    async def until(self, ready: Callable[[], bool], deadline: float) -> bool:
        """True once ``ready()`` holds, False at ``deadline`` (time.monotonic())."""
        loop = asyncio.get_running_loop()
        while True:
            future: asyncio.Future[None] = loop.create_future()
            with self._lock:  # registered before looking: a change cannot slip between
                self._waiters.add((loop, future))
            if ready():
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(future, remaining)
            except asyncio.TimeoutError:
                pass
            finally:
                with self._lock:
                    self._waiters.discard((loop, future))


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


@dataclass
class _Version:
    """What the mailbox knows of one version."""

    handles: dict[int, Any] = field(default_factory=dict)  # rank -> its handle
    failed: str = ""  # why a rank could not publish it
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> who it is
    received: dict[str, str] = field(default_factory=dict)  # id -> "" or why not
    applied: dict[str, str] = field(default_factory=dict)  # id -> "" or why not
    decision: str = ""  # "commit" or "abort", once rank 0 has decided
    outcome: str | None = None  # "" applied, else the error; None while running
    put_at: float = 0.0  # time.monotonic() of its first handle: 0 if none yet
    relays: dict[str, Any] = field(default_factory=dict)  # key -> relay handle, "" failed


@ray.remote(num_cpus=0, concurrency_groups={"writes": 8, "waits": WAITS})  # type: ignore[call-overload]
class RaydirectMailbox:
    """Versions' handles by rank, the workers taking part, their reports, rank
    0's decision and each version's outcome (see the module docstring)."""

    def __init__(self, ranks: int, timeout: float = 300.0) -> None:
        self._ranks = ranks
        self._timeout = timeout  # every update ends within it (the trainer's init info)
        self._versions: dict[int, _Version] = {}
        self._tokens: dict[int, ray.ObjectRef] = {}
        self._dead: set[int] = set()
        self._worker_tokens: dict[str, ray.ObjectRef] = {}
        self._dead_workers: set[str] = set()
        self._last = 0  # the newest version put or ended
        self._changes = _Changes()
        self._watching = False
        self._waiting = 0
        self._lock = threading.Lock()  # the records, against the other group's thread

    def ranks(self) -> int:
        return self._ranks

    def _version(self, version: int) -> _Version:
        with self._lock:
            record = self._versions.get(version)
            if record is None:
                record = self._versions[version] = _Version()
                for old in [v for v in self._versions if v < version - _KEPT]:
                    del self._versions[old]
            return record

    def _older(self, version: int) -> list[_Version]:
        with self._lock:
            return [record for v, record in self._versions.items() if v < version]

    # ------------------------------------------------------------------ writes

    @ray.method(concurrency_group="writes")
    def alive(self, rank: int, token: list[ray.ObjectRef]) -> None:
        """``token``: ``[ref]`` of an object ``rank`` owns (in a list, so Ray keeps
        it a ref instead of resolving it)."""
        self._tokens[rank] = token[0]
        self._dead.discard(rank)

    @ray.method(concurrency_group="writes")
    def put(self, version: int, rank: int, handle: list[Any]) -> None:
        record = self._version(version)
        if record.failed or record.decision == "abort" or record.outcome is not None:
            return  # ended already: nobody may read it, its rank must not wait for readers
        record.handles[rank] = handle[0]
        record.put_at = record.put_at or time.monotonic()
        self._last = max(self._last, version)
        for record in self._older(version):  # a newer version supersedes them
            record.handles.clear()
        self._changes.notify()

    @ray.method(concurrency_group="writes")
    def fail(self, version: int, rank: int, why: str) -> None:
        record = self._version(version)
        record.failed = f"trainer rank {rank} could not publish version {version}: {why}"
        record.handles.clear()  # no worker may read the others' part of it now
        self._changes.notify()

    @ray.method(concurrency_group="writes")
    def join(
        self, version: int, worker: str, who: dict[str, Any], token: list[Any] | None = None
    ) -> None:
        """Worker ``worker`` takes part in ``version`` (``who``: its engine, rank,
        world and a label for messages; ``token``: ``[ref]`` of an object it owns,
        its alive token)."""
        self._version(version).workers[worker] = who
        if token:
            self._worker_tokens[worker] = token[0]
        self._changes.notify()

    @ray.method(concurrency_group="writes")
    def report(self, version: int, worker: str, phase: str, error: str) -> None:
        """A worker's phase ``"received"`` or ``"applied"``: ``""``, else why not."""
        record = self._version(version)
        (record.received if phase == "received" else record.applied)[worker] = error
        self._changes.notify()

    @ray.method(concurrency_group="writes")
    def decide(self, version: int, commit: bool) -> None:
        record = self._version(version)
        record.decision = "commit" if commit else "abort"
        if not commit:
            record.handles.clear()
        self._changes.notify()

    @ray.method(concurrency_group="writes")
    def done(self, version: int, error: str) -> None:
        """Rank 0 says how ``version`` ended: ``""`` applied, else the error."""
        record = self._version(version)
        record.outcome = error
        record.handles.clear()
        record.relays.clear()
        self._last = max(self._last, version)
        self._changes.notify()

    @ray.method(concurrency_group="writes")
    def lead(self, version: int, key: str) -> bool:
        """True for the first worker of ``key`` (its node and what it reads) to ask
        about ``version``: it reads from the ranks and relays to the others."""
        for record in self._older(version):
            record.relays.clear()
        relays = self._version(version).relays
        if key in relays:
            return False
        relays[key] = None
        return True

    @ray.method(concurrency_group="writes")
    def relayed(self, version: int, key: str, handle: list[Any]) -> None:
        """The leader's relay of ``version`` (``[handle]``, or ``[""]`` if it failed)."""
        relays = self._version(version).relays
        if key in relays:
            relays[key] = handle[0]
            self._changes.notify()

    # ------------------------------------------------------------------ reads

    def waiting(self) -> int:
        """How many calls wait in the mailbox now."""
        return self._waiting

    def decision(self, version: int) -> str:
        """``"commit"``, ``"abort"``, or ``""`` if rank 0 has not decided."""
        record = self._versions.get(version)
        return record.decision if record is not None else ""

    def updating(self) -> int:
        """The version whose update is under way (handles put, its end not yet
        said by rank 0), or 0: an engine's init by another trainer is refused
        while it is, from before its first vLLM call to after its last. One
        older than the trainer's timeout is not: every update ends within it."""
        now = time.monotonic()
        with self._lock:
            live = [
                v
                for v, r in self._versions.items()
                if r.put_at
                and r.outcome is None
                and not r.failed
                and now - r.put_at < self._timeout
            ]
        return max(live, default=0)

    async def dead_ranks(self) -> list[int]:
        """The ranks whose alive token Ray has lost: their process died."""
        await self._look()
        return sorted(self._dead)

    # ------------------------------------------------------------------ waits

    @ray.method(concurrency_group="waits")
    async def take(self, version: int, timeout: float) -> list[Any]:
        """Every rank's handle of ``version``, in rank order, once all are in.
        Raises (naming the rank) when a rank failed or died, when a newer version
        superseded it or it ended, or at the deadline."""
        record = self._version(version)

        def settled() -> bool:
            return bool(
                len(record.handles) == self._ranks
                or record.failed
                or record.decision == "abort"
                or record.outcome is not None
                or version < self._last
                or self._missing_dead(record)
            )

        await self._wait(settled, timeout)
        if record.failed:
            raise RuntimeError(record.failed)
        if len(record.handles) == self._ranks and record.decision != "abort":
            return [record.handles[r] for r in range(self._ranks)]
        if dead := self._missing_dead(record):
            raise RuntimeError(f"trainer rank(s) {dead} died before publishing version {version}")
        if record.decision == "abort" or record.outcome is not None or version < self._last:
            raise RuntimeError(f"version {version} is gone: the trainer has ended it")
        missing = [r for r in range(self._ranks) if r not in record.handles]
        raise TimeoutError(
            f"version {version}: no handle from trainer rank(s) {missing} within "
            f"{timeout:.1f} s (RaydirectTrainerInitInfo.timeout)"
        )

    def _missing_dead(self, record: _Version) -> list[int]:
        return [r for r in sorted(self._dead) if r not in record.handles]

    @ray.method(concurrency_group="waits")
    async def decided(self, version: int, timeout: float) -> str:
        """Rank 0's decision on ``version`` once made (``""`` if none by the deadline):
        a worker asks as it joins, and has the answer when the session finishes."""
        record = self._version(version)
        await self._wait(lambda: bool(record.decision) or record.outcome is not None, timeout)
        return record.decision or ("abort" if record.outcome is not None else "")

    @ray.method(concurrency_group="waits")
    async def reports(self, version: int, phase: str, timeout: float) -> dict[str, Any]:
        """Rank 0: every joined worker's report of ``phase`` once all are in (or at
        the deadline): ``{"workers": {id: who}, "said": {id: error}}``; a worker
        missing from ``said`` did not report in time."""
        record = self._version(version)
        said = record.received if phase == "received" else record.applied
        await self._wait(lambda: set(record.workers) <= set(said) | self._dead_workers, timeout)
        died = sorted((set(record.workers) & self._dead_workers) - set(said))
        return {"workers": dict(record.workers), "said": dict(said), "died": died}

    @ray.method(concurrency_group="waits")
    async def relay(self, version: int, key: str, timeout: float) -> Any:
        """The relay's handle once its leader has received ``version``, or None (read
        from the ranks) if the leader failed or did not finish in ``timeout``."""
        relays = self._version(version).relays
        await self._wait(lambda: key not in relays or relays[key] is not None, timeout)
        return relays.get(key) or None

    @ray.method(concurrency_group="waits")
    async def outcome(self, version: int, timeout: float) -> str:
        """How ``version`` ended, for the ranks other than 0: at once when a rank
        could not publish it or rank 0 died, else once rank 0 says (``done``)."""
        record = self._version(version)
        await self._wait(
            lambda: record.outcome is not None or bool(record.failed) or 0 in self._dead, timeout
        )
        if record.outcome is not None:
            return record.outcome
        if record.failed:
            return (
                f"version {version} was not applied: {record.failed}. No engine loaded it: "
                "the engines keep serving the weights they held before this update"
            )
        if 0 in self._dead:
            return f"trainer rank 0, which drives the engines, died during version {version}"
        return (
            f"trainer rank 0 did not finish version {version} within {timeout:.1f} s "
            "(RaydirectTrainerInitInfo.timeout)"
        )

    async def _wait(self, ready: Callable[[], bool], timeout: float) -> bool:
        """Waits for ``ready()`` up to ``timeout`` s, the ranks watched meanwhile."""
        self._waiting += 1
        if not self._watching:
            self._watching = True
            asyncio.get_running_loop().create_task(self._watch())
        try:
            return await self._changes.until(ready, time.monotonic() + timeout)
        finally:
            self._waiting -= 1

    async def _watch(self) -> None:
        """While anyone waits: marks the ranks whose alive token Ray lost as dead."""
        try:
            while self._waiting > 0:
                await self._look()
                await asyncio.sleep(_WATCH)
        finally:
            self._watching = False

    async def _look(self) -> None:
        """A token whose owner died raises within moments when awaited; a live
        one's is local after its first fetch."""
        for rank, token in sorted(self._tokens.items()):
            if rank not in self._dead and not await _alive(token):
                self._dead.add(rank)
                self._changes.notify()
        for worker, token in list(self._worker_tokens.items()):
            if worker not in self._dead_workers and not await _alive(token):
                self._dead_workers.add(worker)
                self._changes.notify()


async def _alive(token: ray.ObjectRef) -> bool:
    """False once Ray has lost ``token``: its owner died. A live one's is local
    after its first fetch; one not yet fetched counts as alive."""
    try:
        await asyncio.wait_for(_fetched(token), _CHECK)
    except asyncio.TimeoutError:
        return True
    except ray.exceptions.RayError:
        return False
    return True
