"""Opt-in lifetimes: objects freed after N reads or at a deadline, with no lease.

By default an object a method returns lives as long as Ray's reference counting
says; what tells the producer is a lease (``_lease``), a Ray object of its own
with a pubsub round each. A method that knows its readers (a pipeline stage read
once, a hand-off read by one engine) says so instead:
``@rd.method(reads=1, ttl=30)``. Its objects carry no lease; the producer frees
each after its ``reads``-th read or ``ttl`` seconds after it was made, whichever
comes first, whatever refs to it remain.

Freed while refs remain, such an object is guarded as a region is
(``_regions``): readers that copy from its memory without the producer's agent
(``cma``, ``cuda_ipc``, ``nixl``) check a seal after they read, the agent
copies the reads it serves (``shm``, ``tcp``) out under ``Serving``, and the
free zeroes the seal and waits for those copies before the memory can go
(``release``, from the store's free). A read after the free gets
``ProducerLostError`` naming the lifetime (``store.why_freed``), never stale or
foreign bytes. The seal is every object's (``Store.seal``); what a lifetime adds
is ``Serving``. Host and CUDA memory alike: on the GPU, ``cuda_ipc`` on one node
and ``nixl`` across nodes.

A read counts when the producer learns it was made: an ``shm`` read when its
agent served it, a ``tcp`` read when its agent sent the last byte (a stream that
failed midway used none), a read in this process when it is made, a one-sided read
(``cma``, ``cuda_ipc``, ``nixl``) when its notice arrives (``_notices``: 2-20 ms
after it). So a read that starts
before the last counted one's notice arrives still succeeds: the count frees
memory, it does not ration reads.
"""

from __future__ import annotations

import heapq
import logging
import math
import os
import threading
import time
from dataclasses import dataclass

from raydirect._store import Serving, StoredObject, store

log = logging.getLogger("raydirect")

# What reads such an object: the transports whose reads are guarded as above
# (nixl READs the seal after its data). A group's send and a plug-in need the
# producer in the read, which a lease-free free races.
TRANSPORTS = frozenset({"auto", "cma", "cuda_ipc", "nixl", "shm", "tcp"})
_WAIT_LOG_S = 10.0
# Deadlines of freed objects the ttl heap may hold beyond twice the live ones
# before it is rebuilt without them (amortised: each rebuild follows as many frees).
_STALE_DEADLINES = 64


@dataclass(frozen=True)
class Lifetime:
    """``reads``: freed after this many reads; ``ttl``: freed this many seconds
    after it was made; whichever comes first. At least one is set."""

    reads: int | None = None
    ttl: float | None = None

    def __post_init__(self) -> None:
        reads, ttl = self.reads, self.ttl
        if reads is not None and (isinstance(reads, bool) or not isinstance(reads, int)):
            raise TypeError(f"reads must be a whole number of reads, got {reads!r}")
        if reads is not None and reads < 1:
            raise ValueError(f"reads must be at least 1, got {reads}")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float))):
            raise TypeError(f"ttl must be a number of seconds, got {ttl!r}")
        if ttl is not None and not (0 < ttl < math.inf):
            raise ValueError(f"ttl must be a positive, finite number of seconds, got {ttl}")

    def describe(self) -> str:
        """As the user wrote it: ``reads=2, ttl=30``."""
        parts = [f"reads={self.reads}"] if self.reads is not None else []
        return ", ".join(parts + ([f"ttl={self.ttl:g}"] if self.ttl is not None else []))


def check_transport(transport: str) -> None:
    """``ValueError`` unless ``transport`` can read an object with a lifetime."""
    if transport not in TRANSPORTS:
        raise ValueError(
            f"tensor_transport={transport!r} cannot carry reads=/ttl=: an object freed by "
            f"its lifetime is read over {', '.join(sorted(TRANSPORTS))} only (they check "
            "that it is still there); drop reads=/ttl= to keep the default lifetime, which "
            "works over every transport"
        )


@dataclass
class _Tracked:
    obj: StoredObject
    lifetime: Lifetime
    reads_left: int | None
    ended: bool = False  # by a read or the clock: the other no longer ends it


class Lifetimes:
    """The objects of this process that have a lifetime, and its clock."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._tracked: dict[bytes, _Tracked] = {}
        self._deadlines: list[tuple[float, bytes]] = []
        self._clock: threading.Thread | None = None

    def start(self, obj: StoredObject, lifetime: Lifetime) -> None:
        """Guard ``obj`` (not yet in the store) and start its lifetime."""
        obj.live = Serving()
        obj.lifetime = lifetime.describe()
        with self._lock:
            self._tracked[obj.obj_id] = _Tracked(obj, lifetime, lifetime.reads)
            if lifetime.ttl is not None:
                heapq.heappush(self._deadlines, (time.monotonic() + lifetime.ttl, obj.obj_id))
                self._start_clock()
                # The clock waits for the earliest deadline: woken by every export
                # (a thread switch each, on the producer's path), it only waited again.
                if self._deadlines[0][1] == obj.obj_id:
                    self._lock.notify_all()

    def count_read(self, obj: StoredObject) -> None:
        """One read of ``obj`` made; the last its lifetime allows frees it. Free
        for the others: an object with no lifetime has no ``live``."""
        if obj.live is not None:
            self.count_read_of(obj.obj_id)

    def count_read_of(self, obj_id: bytes) -> None:
        """``count_read`` by id: for a read that ends later (a ``tcp`` stream's last
        byte), which then holds no memory of an object freed meanwhile."""
        with self._lock:
            tracked = self._tracked.get(obj_id)
            if tracked is None or tracked.ended or tracked.reads_left is None:
                return
            tracked.reads_left -= 1
            if tracked.reads_left > 0:
                return
            reads = tracked.lifetime.reads
            self._end(obj_id, f"after its {reads} read{'s' if reads != 1 else ''}", tracked)

    def release(self, obj: StoredObject) -> None:
        """On ``obj``'s free (the reaper), after the store released its seal: no
        read the agent serves still copies from its memory on return."""
        with self._lock:
            tracked = self._tracked.pop(obj.obj_id, None)
            # An object freed by its reads leaves its deadline in the heap until
            # the ttl: at 1,000 objects a second with ttl=600, 600,000 of them.
            if len(self._deadlines) > 2 * len(self._tracked) + _STALE_DEADLINES:
                self._deadlines = [d for d in self._deadlines if d[1] in self._tracked]
                heapq.heapify(self._deadlines)
        if tracked is None or obj.live is None:
            return
        while not obj.live.close(_WAIT_LOG_S):  # each is a bounded copy: never gives up
            log.warning("raydirect: freeing %s waits for reads its agent still copies", obj.label)

    def _end(self, obj_id: bytes, why: str, tracked: _Tracked) -> None:
        """Under the lock: ``obj_id``'s lifetime is over; free it (on the reaper)."""
        tracked.ended = True
        store.free_later(obj_id, why=f"{why} (rd.method({tracked.lifetime.describe()}))")

    def _start_clock(self) -> None:
        if self._clock is None:
            self._clock = threading.Thread(target=self._tick, name="raydirect-ttl", daemon=True)
            self._clock.start()

    def _tick(self) -> None:
        with self._lock:
            while True:
                now = time.monotonic()
                while self._deadlines and self._deadlines[0][0] <= now:
                    _, obj_id = heapq.heappop(self._deadlines)
                    tracked = self._tracked.get(obj_id)
                    if tracked is not None and not tracked.ended:
                        ttl = tracked.lifetime.ttl
                        self._end(obj_id, f"at its ttl, {ttl:g} s after it was made", tracked)
                wait = self._deadlines[0][0] - now if self._deadlines else None
                self._lock.wait(wait)

    def forget_after_fork(self) -> None:
        # The parent's objects are the parent's; the clock thread did not survive.
        self.__init__()  # type: ignore[misc]


lifetimes = Lifetimes()
os.register_at_fork(after_in_child=lifetimes.forget_after_fork)
