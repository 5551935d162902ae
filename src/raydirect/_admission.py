"""Admission control for the agent: who gets a worker thread, decided on the
agent's loop thread before any decoding.

Only peers that completed the CURVE handshake reach this point (``_gate``:
where Ray's token authentication is on, that means holding the cluster's key),
so nothing here is about strangers. Before this, every message was queued for
a worker without bound and served in arrival order: two local clients sending
as fast as they could starved a real transfer for a minute. Now, per message
and in this order:

1. *Shape*: exactly an identity and one frame, else dropped.
2. *Per-peer limit*: at most ``PEER_IN_FLIGHT`` requests of one connection
   queued or running; beyond that the peer is told the agent is busy.
3. *Bounded lanes*: at most ``LANE_QUEUE`` requests waiting per lane; beyond
   that, busy.

ZeroMQ's ROUTER already reads its connections fairly (one message from each in
turn), so a consumer's request waits behind at most one message per flooding
connection, and those cost a fixed-size peek each (``_server._peek_op``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

log = logging.getLogger("raydirect")

PEER_IN_FLIGHT = 64
LANE_QUEUE = 1024
LOG_EVERY_S = 10.0
LOG_BURST = 10


class RateLimitedLog:
    """At most ``burst`` warnings per kind per ``LOG_EVERY_S``; the next one logged
    says how many were held back. A flood must not become a flood of log lines,
    while a few refusals (a misconfigured peer) are each seen."""

    def __init__(self, every: float = LOG_EVERY_S, burst: int = LOG_BURST) -> None:
        self._every, self._burst = every, burst
        self._window: dict[str, tuple[float, int]] = {}  # kind -> (start, logged in it)
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    def warning(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            start, logged = self._window.get(kind, (now, 0))
            if now - start >= self._every:
                start, logged = now, 0
            if logged >= self._burst:
                self._window[kind] = (start, logged)
                self._held[kind] += 1
                return
            self._window[kind] = (start, logged + 1)
            held, self._held[kind] = self._held[kind], 0
        suffix = f" ({held} more like it not logged)" if held else ""
        log.warning(message + suffix, *args)


class Admission:
    """Counts of requests queued or running, per peer and per lane."""

    def __init__(self, lanes: tuple[str, ...]) -> None:
        self._peers: Counter[bytes] = Counter()
        self._lanes: Counter[str] = Counter({lane: 0 for lane in lanes})
        self._lock = threading.Lock()
        self.refused: Counter[str] = Counter()  # reason -> count, for stats and tests
        self.admitted = 0  # requests let through to a lane, ever

    def admit(self, peer: bytes, lane: str) -> str | None:
        """None if the request may be queued (then call ``done`` when it ends), else
        why not."""
        with self._lock:
            if self._peers[peer] >= PEER_IN_FLIGHT:
                reason = f"{PEER_IN_FLIGHT} requests of this consumer are already in flight"
            elif self._lanes[lane] >= LANE_QUEUE:
                reason = f"{LANE_QUEUE} requests are already waiting"
            else:
                self._peers[peer] += 1
                self._lanes[lane] += 1
                self.admitted += 1
                return None
            self.refused["busy"] += 1
            return reason

    def done(self, peer: bytes, lane: str) -> None:
        with self._lock:
            self._lanes[lane] -= 1
            self._peers[peer] -= 1
            if self._peers[peer] <= 0:
                del self._peers[peer]

    def note(self, reason: str) -> None:
        with self._lock:
            self.refused[reason] += 1

    def in_flight(self) -> int:
        with self._lock:
            return sum(self._lanes.values())
