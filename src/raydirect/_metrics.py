"""raydirect's counters as Ray metrics, so they show on Ray's dashboard and in Prometheus.

Each process that holds or moves raydirect objects exports, tagged by transport:

- gauges ``raydirect_objects_held``, ``raydirect_bytes_held``: producer copies
  held now, by the transport they were exported with;
- counters ``raydirect_objects_sent``, ``raydirect_bytes_sent``: transfers served
  to other processes; ``raydirect_objects_received``, ``raydirect_bytes_received``:
  objects fetched. Prometheus shows them with Ray's ``ray_`` prefix and a
  ``_total`` suffix, tagged with Ray's ``WorkerId``, ``NodeAddress`` and so on.

A daemon thread copies ``LocalStats`` into Ray's metrics every few seconds, so
the transfer path pays nothing (Ray's own report interval is seconds anyway).
It starts with the first object or transfer in a process connected to Ray
(``ray.util.metrics`` needs a connected worker or driver), and also starts the
process's agent if it has none, so that ``raydirect status`` lists processes
that only receive.

``RAYDIRECT_METRICS=0`` turns the export off; ``RAYDIRECT_METRICS_INTERVAL_S``
sets the period (default 5 s).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import ray

from raydirect import _ray, _runtime
from raydirect._store import LocalStats, store

log = logging.getLogger("raydirect")

GAUGES = {
    "objects_held": "Objects a process holds as producer copies, by export transport.",
    "bytes_held": "Tensor bytes a process holds as producer copies, by export transport.",
}
COUNTERS = {
    "objects_sent": "Objects served to other processes, by transport.",
    "bytes_sent": "Tensor bytes served to other processes, by transport.",
    "objects_received": "Objects fetched by this process, by transport.",
    "bytes_received": "Tensor bytes fetched by this process, by transport.",
}
PREFIX = "raydirect_"
TAG = "transport"

_lock = threading.Lock()
_thread: threading.Thread | None = None


def interval_s() -> float:
    try:
        return max(0.1, float(os.environ.get("RAYDIRECT_METRICS_INTERVAL_S", "5")))
    except ValueError:
        return 5.0


def enabled() -> bool:
    return os.environ.get("RAYDIRECT_METRICS", "1").strip().lower() not in ("0", "false", "no")


class Exporter:
    """Copies one process's ``LocalStats`` into Ray metrics (gauges set, counters
    advanced by what changed since the last export)."""

    def __init__(self) -> None:
        from ray.util.metrics import Counter, Gauge

        self._gauges = {
            k: Gauge(PREFIX + k, description=d, tag_keys=(TAG,)) for k, d in GAUGES.items()
        }
        self._counters = {
            k: Counter(PREFIX + k, description=d, tag_keys=(TAG,)) for k, d in COUNTERS.items()
        }
        self._exported: dict[str, dict[str, int]] = {k: {} for k in COUNTERS}
        self._gauge_tags: dict[str, set[str]] = {k: set() for k in GAUGES}

    def export(self, stats: LocalStats) -> None:
        for key, gauge in self._gauges.items():
            values: dict[str, int] = getattr(stats, key)
            # A transport whose last object was freed must drop to 0, not stay stale.
            seen = self._gauge_tags[key]
            seen.update(values)
            for transport in seen:
                gauge.set(values.get(transport, 0), tags={TAG: transport})
        for key, counter in self._counters.items():
            totals: dict[str, int] = getattr(stats, key)
            done = self._exported[key]
            for transport, total in totals.items():
                delta = total - done.get(transport, 0)
                if delta > 0:
                    counter.inc(delta, tags={TAG: transport})
                    done[transport] = total


def start(stats: Callable[[], LocalStats] = store.stats) -> bool:
    """Start this process's observer thread, once it is connected to Ray. True once
    there is nothing left to do; False to be asked again later (not connected yet)."""
    global _thread
    if not ray.is_initialized():
        return False
    with _lock:
        if _thread is None:
            # Named after the task that first used raydirect here, read in its own thread
            # (from the observer thread every process would look like the driver).
            label = _ray.current_task_label()
            _thread = threading.Thread(
                target=_run, args=(stats, label), name="raydirect-metrics", daemon=True
            )
            _thread.start()
    return True


def _run(stats: Callable[[], LocalStats], label: str) -> None:
    try:
        # A process that only receives has no agent yet: start one (off the transfer
        # path) so that `raydirect status` lists its received counters too.
        _runtime.agent(label)
    except Exception:
        log.debug("raydirect: could not start the agent for status", exc_info=True)
    if not enabled():
        return
    period = interval_s()
    exporter: Exporter | None = None
    failures = 0
    tick = threading.Event()  # never set: the thread lives as long as the process
    while True:
        try:
            # A driver may shut Ray down and connect again: export only while connected.
            if ray.is_initialized():
                exporter = exporter or Exporter()
                exporter.export(stats())
        except Exception:  # metrics are a convenience: never let them take a process down
            failures += 1
            if failures == 1:
                log.warning("raydirect: exporting Ray metrics failed", exc_info=True)
        tick.wait(period)


# Started by the store on this process's first object or transfer: only processes
# that use raydirect export metrics, and only once they are connected to Ray.
store.on_first_use(start)


def _forget_after_fork() -> None:
    global _thread, _lock
    _thread, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
