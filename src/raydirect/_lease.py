"""Leases the producer owns: tiny Ray objects whose lifetime is a direct object's.

A method called through an actor handle leases on its caller's token instead
(``_caller_leases``); these stand in where there is none, and are the watches
that tell a producer its callers died.

The producer owns each lease and nests it in the Payload. Ray's reference
counting (local refs, borrowers, nested refs, pending tasks) then keeps the
lease alive exactly as long as any ref to the direct object is alive; its
out-of-scope callback frees the producer's copy.

In an actor a lease is one of the returns of a task the actor sends itself
(``_ray.mint_own_refs``, 64 per task): it lives in the actor's memory store.
Ray 2.60 makes every ``ray.put`` a plasma object instead (it inlines puts only
in local mode), pinned by the raylet with its own eviction pubsub: measured in
blocks of consecutive transfers, a ``ray.put`` lease adds 1.2-2.9 ms and
2.4-4 ms of CPU to a 1 MiB transfer, a minted one 0.8-1.1 ms and 1.4-2.4 ms
(docs/benchmarks.md, workload 8). Leases are minted ahead by a background
thread; a call takes one (registering the callback costs ~2 us). ``ray.put``
stays the lease where none is ready: in a driver or a task (no actor to call),
while a long method holds a single-threaded actor (its self-call waits behind
it), or under a ``max_pending_calls`` limit. ``rd.put`` takes no lease at all:
its callback sits on its own put ref; ``@rd.method(reads=, ttl=)`` neither
(``_lifetime``).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable

import ray

from raydirect import _ray

log = logging.getLogger(__name__)

_MINTED = 64  # leases per self-call
_TARGET = 2 * _MINTED  # leases kept ready
_REFILL_BELOW = _MINTED


class LeasePool:
    def __init__(self) -> None:
        self._ready: collections.deque[ray.ObjectRef] = collections.deque()
        self._lock = threading.Lock()
        self._wanted = threading.Event()
        self._thread: threading.Thread | None = None
        self._session: tuple[int, str] | None = None
        self._self_calls = True  # False once this actor refused one: ray.put then

    def take(self, on_released: Callable[[], None]) -> ray.ObjectRef:
        """A lease whose release calls ``on_released`` (on a Ray thread; keep it short)."""
        session = _ray.session_key()
        if session != self._session:  # leases of an earlier Ray session are void
            self._ready.clear()
            self._session = session
        try:
            lease = self._ready.popleft()
        except IndexError:
            lease = ray.put(b"")
        if len(self._ready) < _REFILL_BELOW:
            self._start_refill()
        if not _ray.add_out_of_scope_callback(lease, lambda _id: on_released()):
            on_released()  # cannot happen while we hold ``lease``; stay correct anyway
        return lease

    def _start_refill(self) -> None:
        self._wanted.set()
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._refill, name="raydirect-leases", daemon=True
                    )
                    self._thread.start()

    def forget_after_fork(self) -> None:
        """Leases belong to the parent's Ray session; its refill thread is gone."""
        self._ready.clear()
        self._lock = threading.Lock()
        self._thread = None
        self._session = None

    def _refill(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            try:
                while len(self._ready) < _TARGET:
                    self._ready.extend(self._made())
            except Exception:  # Ray shut down: a later take() starts a new refiller
                with self._lock:
                    self._thread = None
                return

    def _made(self) -> list[ray.ObjectRef]:
        """The next leases: minted by a self-call in an actor, else one ``ray.put``."""
        handle = _ray.current_actor_handle() if self._self_calls else None
        if handle is None:
            return [ray.put(b"")]
        try:
            return _ray.mint_own_refs(handle, _MINTED)
        except ray.exceptions.PendingCallsLimitExceeded as exc:
            self._self_calls = False
            log.info("raydirect: leases by ray.put in this actor (%s)", exc)
            return [ray.put(b"")]


leases = LeasePool()


os.register_at_fork(after_in_child=leases.forget_after_fork)
