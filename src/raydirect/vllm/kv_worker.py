"""The worker side of ``RaydirectConnector``: one per engine worker (TP rank).

Prefill side: the worker exports its paged KV caches as one region at
``register_kv_caches`` and keeps it open for its life. The scheduler hands it,
each step, the leases of finished prefills (request -> the wall-clock time at
which their blocks are freed). A decode worker's notice (it read the blocks, or
will not read them) arrives on a thread of raydirect's and is only recorded;
``results`` reports a lease as sent when its notice came or its time is up, and
vLLM frees the blocks.

Decode side: each read runs on a small pool of threads (idle threads block;
nothing polls): ``rd.read_ranges`` straight from the prefill worker's memory into
the request's newly allocated blocks, bounded by the lease; the request is
reported done, then the prefill worker is sent its notice, by a thread of that
prefill rank's (``Notifier``): one engine slow to answer holds up no read.
A read that fails (the prefill engine gone, the lease over, another layout)
reports its blocks as load errors, so vLLM's ``kv_load_failure_policy``
recomputes them or fails the request.

Neither side touches thread affinity or spins.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

import raydirect as rd
from raydirect.vllm import cluster
from raydirect.vllm.kv_handoff import READ_MARGIN_S, Handshake, KVMetadata, Read
from raydirect.vllm.kv_layout import CacheLayout, block_rows, layout_of
from raydirect.vllm.kv_params import MAX_ID_CHARS

logger = logging.getLogger(__name__)

READ_THREADS = 2
NOTICE_TIMEOUT_S = 5.0
# A notice for a lease this worker has not been handed yet (it may arrive a step
# early) is kept this long, and at most this many: notices come from any holder
# of the region's handle, and one naming a lease this worker never held or no
# longer holds (a late reader's, a forged one) is a stray, counted and dropped.
STRAY_NOTICE_S = 120.0
MAX_NOTICES = 4096
STATUS_KEPT = 64

_workers: list[KVWorker] = []  # this process's workers (status(), tests)


class KVWorker:
    """A worker's share of the connector (module docstring)."""

    def __init__(self, num_blocks: int, rank: int, tp_size: int, huge_pages: bool = True) -> None:
        self.num_blocks = num_blocks
        self.rank = rank
        self.tp_size = tp_size
        self.huge_pages = huge_pages
        self.layout: CacheLayout | None = None
        self.region: rd.Region | None = None
        self._lock = threading.Lock()
        self._leases: dict[str, float] = {}  # request -> wall-clock expiry
        # request -> when it arrived (monotonic), oldest first
        self._notices: dict[str, float] = {}
        self._strays = 0
        self._done: set[str] = set()
        self._bad_blocks: set[int] = set()
        self._expired = 0
        # the last reads: what each moved, and the prefill requests whose read failed
        self._reads: deque[dict[str, Any]] = deque(maxlen=STATUS_KEPT)
        self._failed: deque[str] = deque(maxlen=STATUS_KEPT)
        self._pool: ThreadPoolExecutor | None = None
        self._notifier = Notifier()
        _workers.append(self)

    # -- both sides ---------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Exports the caches as this worker's region (joining the engine's Ray
        cluster first)."""
        devices = {t.device.type for t in kv_caches.values()}
        if devices != {"cpu"}:
            raise NotImplementedError(
                f"RaydirectConnector: the KV caches are on {sorted(devices)}; raydirect's "
                "regions expose host memory for now (CUDA regions are not yet there). Use "
                "NixlConnector on GPUs, or the CPU backend"
            )
        cluster.join_own()
        self.layout = layout_of(kv_caches, self.num_blocks)
        self.region = rd.export_region(
            self.layout.storages,
            name=f"kv-cache-rank{self.rank}",
            on_notice=self._on_notice,
            huge_pages=self.huge_pages,
        )

    def handshake(self) -> Handshake:
        assert self.region is not None and self.layout is not None, "register_kv_caches first"
        return Handshake(region=self.region.handle().to_dict(), layout=self.layout.to_dict())

    def start(self, meta: KVMetadata) -> None:
        """Takes a step's leases and starts its reads (in the background)."""
        if meta.leases:
            with self._lock:
                self._leases.update(meta.leases)
        for read in meta.reads:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="raydirect-kv")
            self._pool.submit(self._run, read)

    def results(self) -> tuple[set[str], set[str]]:
        """(leases ended: notified or expired, reads ended: done or failed)."""
        now, mono = time.time(), time.monotonic()
        with self._lock:
            sent = {r for r, t in self._leases.items() if r in self._notices or now >= t}
            for req in sent:
                if self._notices.pop(req, None) is None:
                    self._expired += 1
                    logger.warning(
                        "RaydirectConnector: the lease of request %s ended with no reader; "
                        "its blocks are freed",
                        req,
                    )
                del self._leases[req]
            self._drop_strays(lambda arrived: mono - arrived > STRAY_NOTICE_S)
            done, self._done = self._done, set()
        return sent, done

    def _drop_strays(self, stale: Callable[[float], bool]) -> None:
        """Drops the oldest notices while ``stale(arrival)`` (under the lock), as
        strays: counted, and the first one logged (a flood of them must not
        flood the log too)."""
        while self._notices:
            request, arrived = next(iter(self._notices.items()))
            if not stale(arrived):
                return
            del self._notices[request]
            self._strays += 1
            if self._strays == 1:
                logger.warning(
                    "RaydirectConnector: a notice named request %s, whose blocks this worker "
                    "does not hold (its lease ended first, or it never was this worker's); "
                    "dropped. Later ones are only counted (the worker's status: strays)",
                    request[:200],
                )

    def load_errors(self) -> set[int]:
        with self._lock:
            bad, self._bad_blocks = self._bad_blocks, set()
        return bad

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "rank": self.rank,
                "leases": sorted(self._leases),
                "expired": self._expired,
                "strays": self._strays,
                "reads": list(self._reads),
                "failed": list(self._failed),
                "notices": self._notifier.pending(),
            }

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self.region is not None:
            with contextlib.suppress(Exception):  # a read in flight: it fails, as it should
                self.region.close(timeout=5.0)
        with contextlib.suppress(ValueError):
            _workers.remove(self)

    # -- prefill side -------------------------------------------------------

    def _on_notice(self, message: Any) -> None:
        """A decode worker read a request's blocks, or will not: free them."""
        if not isinstance(message, dict):
            return
        request = message.get("request")
        if not isinstance(request, str) or len(request) > MAX_ID_CHARS:
            return
        with self._lock:
            self._notices.pop(request, None)  # to the end: the dict stays in arrival order
            self._notices[request] = time.monotonic()
            if len(self._notices) > MAX_NOTICES:
                self._drop_strays(lambda _: len(self._notices) > MAX_NOTICES)

    # -- decode side --------------------------------------------------------

    def _run(self, read: Read) -> None:
        if not read.local:
            self._notify(read)
            if read.awaiting:
                with self._lock:
                    self._done.add(read.request_id)
            return
        started = time.perf_counter()
        try:
            nbytes = self._read(read)
        except Exception as exc:
            logger.warning(
                "RaydirectConnector: reading request %s's KV from the prefill engine failed "
                "(%s); its %d blocks are reported as load errors (kv_load_failure_policy "
                "decides: recompute or fail)",
                read.request_id,
                exc,
                len(read.local),
            )
            with self._lock:
                self._bad_blocks.update(read.local)
                self._done.add(read.request_id)
                self._failed.append(read.handoff.remote_request_id)
            if not isinstance(exc, rd.ProducerLostError):
                self._notify(read)  # let the prefill engine free them now
            return
        seconds = time.perf_counter() - started
        with self._lock:
            self._reads.append(
                {
                    "request": read.request_id,
                    "remote": read.handoff.remote_request_id,
                    "blocks": len(read.local),
                    "bytes": nbytes,
                    "seconds": seconds,
                }
            )
            self._done.add(read.request_id)
        # Only now: the request goes on while the notice waits for the prefill
        # engine's agent, whose reply is slow while that engine steps.
        self._notify(read)

    def _read(self, read: Read) -> int:
        assert self.layout is not None
        handoff = read.handoff
        if read.error is not None:
            raise ValueError(read.error)
        rows = block_rows(handoff.layout, self.layout.layers, read.remote, read.local)
        left = handoff.seconds_left()
        if left <= 0:
            raise TimeoutError(
                f"the prefill engine's lease of these blocks ends in "
                f"{left + READ_MARGIN_S:.1f}s: too late to read them"
            )
        return rd.read_ranges(
            handoff.regions[self.rank], rows, into=self.layout.storages, timeout=left
        )

    def _notify(self, read: Read) -> None:
        """Tells the prefill engine's ranks this one speaks for (its own, at equal
        TP) to free the request's blocks (in the background: ``Notifier``)."""
        handoff = read.handoff
        for region in handoff.regions[self.rank :: self.tp_size]:
            self._notifier.send(region, handoff.remote_request_id)


class Notifier:
    """Sends decode-side notices to prefill ranks: one thread per prefill rank,
    only while it has notices to send. A notice waits for the prefill engine's
    agent (up to ``NOTICE_TIMEOUT_S``); sent from the read threads, notices to one
    engine that did not answer (stopped, overloaded) held those threads, and the
    reads of every other engine's hand-offs waited behind them until their leases
    ran out. Best effort: the lease frees the blocks of a notice that is lost."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, deque[tuple[rd.RegionHandle, str]]] = {}

    def send(self, region: rd.RegionHandle, request: str) -> None:
        key = region.region
        with self._lock:
            queue = self._queues.get(key)
            if queue is not None:
                queue.append((region, request))
                return
            self._queues[key] = deque([(region, request)])
        threading.Thread(
            target=self._drain, args=(key,), name="raydirect-kv-notices", daemon=True
        ).start()

    def pending(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._queues.values())

    def _drain(self, key: str) -> None:
        while True:
            with self._lock:
                queue = self._queues[key]
                if not queue:
                    del self._queues[key]
                    return
                region, request = queue[0]
            failed: Exception | None = None
            try:
                rd.notify_region(region, {"request": request}, timeout=NOTICE_TIMEOUT_S)
            except Exception as exc:  # its lease frees the blocks anyway
                failed = exc
            with self._lock:
                queue.popleft()  # the sent one stayed first: no second thread meanwhile
                if failed is None:
                    continue
                dropped = len(queue)
                queue.clear()  # to the same engine: they would wait as long
            logger.info(
                "RaydirectConnector: could not tell a prefill engine to free request "
                "%s's blocks (%s), nor %d more queued for it; its lease frees them",
                request,
                failed,
                dropped,
            )


def status() -> list[dict[str, Any]]:
    """What this process's workers hold and read (tests, debugging)."""
    return [w.status() for w in _workers]
