"""The worker side of ``RaydirectConnector``: one per engine worker (TP rank).

Prefill side: the worker exports its paged KV caches as one region at
``register_kv_caches`` and keeps it open for its life; the region's last tensor
holds the hand-offs' seal words (``kv_handoff``). The scheduler hands it, each
step, the seals of requests it is about to prefill for a decode engine and the
leases of finished prefills (request -> seconds, on this worker's monotonic
clock: no other clock frees blocks). A decode worker's notice (it read the
blocks, or will not; or a renewal while its request waits) arrives on a thread
of raydirect's and is only recorded, and only if it carries the hand-off's
secret; ``results`` reports a lease as sent when its notice came or its time is
up, and clears its seal word first: vLLM frees the blocks after.

Decode side: each read runs on a lane of threads of its prefill rank's
(``Lanes``: a stalled prefill engine holds up only its own reads; idle threads
block, nothing polls): ``rd.read_ranges`` straight from the prefill worker's
memory into the request's newly allocated blocks, bounded by the lease, then a
read of the hand-off's seal word (still set: no byte came from freed blocks).
The request is reported done, then the prefill worker is sent its notice, on a
lane of that rank's too: one engine slow to answer holds up no read. A read
that fails (the prefill engine gone, the lease over, another layout) reports its
blocks as load errors, so vLLM's ``kv_load_failure_policy`` recomputes them or
fails the request.

Neither side touches thread affinity or spins.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import raydirect as rd
from raydirect.vllm import cluster
from raydirect.vllm.kv_handoff import (
    KEY_PURPOSE,
    MAX_SEALS,
    Handoff,
    Handshake,
    KVMetadata,
    Read,
    seal_word,
)
from raydirect.vllm.kv_layout import CacheLayout, block_rows, layout_of
from raydirect.vllm.kv_params import MAX_ID_CHARS, MAX_LEASE_S

logger = logging.getLogger(__name__)

# Reads of one prefill rank's hand-offs at once (each prefill rank has a lane).
READ_THREADS = 2
NOTICE_TIMEOUT_S = 5.0
# A notice for a lease this worker has not been handed yet (it may arrive a step
# early) is kept this long, and at most this many: notices come from any holder
# of the region's handle, and one naming a lease this worker never held or no
# longer holds (a late reader's, a forged one) is a stray, counted and dropped.
STRAY_NOTICE_S = 120.0
MAX_NOTICES = 4096
MAX_RENEWALS = 1024  # hand-offs one renewal notice names
STATUS_KEPT = 64

_workers: list[KVWorker] = []  # this process's workers (status(), tests)


@dataclass
class _Held:
    """A lease this worker holds: until ``deadline`` (monotonic), renewed by
    ``lease_s`` at a time, never past ``limit``; its seal."""

    deadline: float
    limit: float
    lease_s: float
    slot: int
    word: int


class KVWorker:
    """A worker's share of the connector (module docstring)."""

    def __init__(self, num_blocks: int, rank: int, tp_size: int, huge_pages: bool = True) -> None:
        self.num_blocks = num_blocks
        self.rank = rank
        self.tp_size = tp_size
        self.huge_pages = huge_pages
        self.layout: CacheLayout | None = None
        self.region: rd.Region | None = None
        self._seals = torch.zeros(MAX_SEALS, dtype=torch.int64)
        self._lock = threading.Lock()
        self._leases: dict[str, _Held] = {}
        # request -> (when it arrived, monotonic; the secret it carries), oldest first
        self._notices: dict[str, tuple[float, str]] = {}
        self._strays = 0
        self._forged = 0
        self._done: set[str] = set()
        self._bad_blocks: set[int] = set()
        self._expired = 0
        self._renewed = 0
        # the last reads: what each moved, and the prefill requests whose read failed
        self._reads: deque[dict[str, Any]] = deque(maxlen=STATUS_KEPT)
        self._failed: deque[str] = deque(maxlen=STATUS_KEPT)
        self._read_lanes = Lanes("raydirect-kv", READ_THREADS)
        self._notifier = Notifier()
        _workers.append(self)

    # -- both sides ---------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor], fingerprint: dict[str, str]) -> None:
        """Exports the caches and the seal words as this worker's region
        (joining the engine's Ray cluster first)."""
        devices = {t.device.type for t in kv_caches.values()}
        if devices != {"cpu"}:
            raise NotImplementedError(
                f"RaydirectConnector: the KV caches are on {sorted(devices)}; raydirect's "
                "regions expose host memory for now (CUDA regions are not yet there). Use "
                "NixlConnector on GPUs, or the CPU backend"
            )
        cluster.join_own()
        self.layout = layout_of(kv_caches, self.num_blocks)
        self._fingerprint = fingerprint
        self._key = rd.cluster_secret(KEY_PURPOSE).hex()
        self.region = rd.export_region(
            [*self.layout.storages, self._seals],
            name=f"kv-cache-rank{self.rank}",
            on_notice=self._on_notice,
            huge_pages=self.huge_pages,
        )

    def handshake(self) -> Handshake:
        assert self.region is not None and self.layout is not None, "register_kv_caches first"
        return Handshake(
            region=self.region.handle().to_dict(),
            layout=self.layout.to_dict(),
            fingerprint=self._fingerprint,
            key=self._key,
        )

    def start(self, meta: KVMetadata) -> None:
        """Takes a step's seals and leases, sends its renewals and starts its
        reads (in the background)."""
        for slot, word in meta.seals.values():
            self._seals[slot] = word  # before the step computes the prompt's KV
        if meta.leases:
            now = time.monotonic()
            with self._lock:
                for request, lease in meta.leases.items():
                    self._leases[request] = _Held(
                        now + lease.seconds,
                        now + MAX_LEASE_S,
                        lease.seconds,
                        lease.slot,
                        lease.word,
                    )
        if meta.renewals:
            self._renew(meta.renewals)
        for read in meta.reads:
            key = read.handoff.regions[self.rank].region if read.handoff.regions else ""
            self._read_lanes.submit(key, functools.partial(self._run, read))

    def results(self) -> tuple[set[str], set[str]]:
        """(leases ended: notified or expired, reads ended: done or failed). An
        ended lease's seal word is cleared here, before vLLM frees its blocks."""
        mono = time.monotonic()
        with self._lock:
            sent = set()
            for request, held in self._leases.items():
                notice = self._notices.get(request)
                if notice is not None and not _proves(notice[1], held.word):
                    del self._notices[request]  # the secret is wrong: not this hand-off's
                    self._forged += 1
                    self._log_forged(request)
                    notice = None
                if notice is not None or mono >= held.deadline:
                    sent.add(request)
            for request in sent:
                held = self._leases.pop(request)
                if self._notices.pop(request, None) is None:
                    self._expired += 1
                    logger.warning(
                        "RaydirectConnector: the lease of request %s ended with no reader; "
                        "its blocks are freed",
                        request,
                    )
                self._clear_seal(held.slot, held.word)
            self._drop_strays(lambda arrived: mono - arrived > STRAY_NOTICE_S)
            done, self._done = self._done, set()
        return sent, done

    def _clear_seal(self, slot: int, word: int) -> None:
        # Seal words are written on the engine's step thread alone (start, results).
        if int(self._seals[slot]) == word:  # else a later hand-off has it already
            self._seals[slot] = 0

    def _log_forged(self, request: str) -> None:
        if self._forged == 1:
            logger.warning(
                "RaydirectConnector: a notice for request %s did not carry its hand-off's "
                "secret (forged, or from an engine that never had the hand-off); ignored. "
                "Later ones are only counted (the worker's status: forged)",
                request[:200],
            )

    def _drop_strays(self, stale: Callable[[float], bool]) -> None:
        """Drops the oldest notices while ``stale(arrival)`` (under the lock), as
        strays: counted, and the first one logged (a flood of them must not
        flood the log too)."""
        while self._notices:
            request, (arrived, _) = next(iter(self._notices.items()))
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
                "forged": self._forged,
                "renewed": self._renewed,
                "reads": list(self._reads),
                "failed": list(self._failed),
                "notices": self._notifier.pending(),
            }

    def shutdown(self) -> None:
        self._read_lanes.close()
        if self.region is not None:
            with contextlib.suppress(Exception):  # a read in flight: it fails, as it should
                self.region.close(timeout=5.0)
        with contextlib.suppress(ValueError):
            _workers.remove(self)

    # -- prefill side -------------------------------------------------------

    def _on_notice(self, message: Any) -> None:
        """A decode worker read a request's blocks, or will not (free them), or
        its request still waits (renew their leases). Only a notice that carries
        the hand-off's secret counts: any holder of the region's handle may
        send one."""
        if not isinstance(message, dict):
            return
        if "renew" in message:
            self._on_renewal(message["renew"])
            return
        request, secret = message.get("request"), message.get("seal")
        if not isinstance(request, str) or not _is_id(request) or not isinstance(secret, str):
            return
        with self._lock:
            self._notices.pop(request, None)  # to the end: the dict stays in arrival order
            self._notices[request] = (time.monotonic(), secret)
            if len(self._notices) > MAX_NOTICES:
                self._drop_strays(lambda _: len(self._notices) > MAX_NOTICES)

    def _on_renewal(self, entries: Any) -> None:
        """Each ``[request, secret]`` held here and proven: its lease runs its
        length again from now, up to ``MAX_LEASE_S`` after it began."""
        if not isinstance(entries, list):
            return
        now = time.monotonic()
        with self._lock:
            for pair in entries[:MAX_RENEWALS]:
                if not (isinstance(pair, list) and len(pair) == 2 and _is_id(pair[0])):
                    continue
                held = self._leases.get(pair[0])
                if held is None or not isinstance(pair[1], str) or not _proves(pair[1], held.word):
                    continue
                held.deadline = min(max(held.deadline, now + held.lease_s), held.limit)
                self._renewed += 1

    # -- decode side --------------------------------------------------------

    def _renew(self, handoffs: list[Handoff]) -> None:
        """Asks the prefill ranks this one speaks for to renew these leases, one
        notice per rank (on its lane)."""
        by_region: dict[str, tuple[rd.RegionHandle, list[list[str]]]] = {}
        for handoff in handoffs:
            for region in handoff.regions[self.rank :: self.tp_size]:
                entry = by_region.setdefault(region.region, (region, []))
                entry[1].append([handoff.remote_request_id, handoff.secret])
        for region, pairs in by_region.values():
            for start in range(0, len(pairs), MAX_RENEWALS):
                self._notifier.send(region, {"renew": pairs[start : start + MAX_RENEWALS]})

    def _run(self, read: Read) -> None:
        if not read.local:
            self._notify(read)
            if read.awaiting:
                with self._lock:
                    self._done.add(read.request_id)
            return
        started = time.perf_counter()
        try:
            nbytes = self._read(read, started)
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

    def _read(self, read: Read, started: float) -> int:
        """The blocks, then the seal word. The word is read after the blocks
        only, as a seqlock's reader does: set then, the prefill worker had not
        cleared it, so vLLM had not freed the blocks while they were read. A
        check before the read would only spare copying a hand-off already gone."""
        assert self.layout is not None
        handoff = read.handoff
        if read.error is not None:
            raise ValueError(read.error)
        rows = block_rows(handoff.layout, self.layout.layers, read.remote, read.local)
        left = read.seconds
        if left <= 0:
            raise TimeoutError(
                "the prefill engine's lease of these blocks ends too soon to read them"
            )
        region = handoff.regions[self.rank]
        nbytes = rd.read_ranges(region, rows, into=self.layout.storages, timeout=left)
        left = max(0.1, read.seconds - (time.perf_counter() - started))
        word = [[len(region.nbytes) - 1, handoff.seal_slot * 8, 8, 0, 0]]
        sealed = torch.zeros(1, dtype=torch.int64)
        rd.read_ranges(region, word, into=[sealed], timeout=left)
        if int(sealed[0]) != handoff.seal_word:
            raise ValueError(
                "the prefill engine freed these blocks while they were read (its lease "
                "ended first): their bytes may be another request's"
            )
        return nbytes

    def _notify(self, read: Read) -> None:
        """Tells the prefill engine's ranks this one speaks for (its own, at equal
        TP) to free the request's blocks (in the background: ``Notifier``)."""
        handoff = read.handoff
        message = {"request": handoff.remote_request_id, "seal": handoff.secret}
        for region in handoff.regions[self.rank :: self.tp_size]:
            self._notifier.send(region, message)


def _is_id(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS


def _proves(secret: str, word: int) -> bool:
    """Whether ``secret`` is the one whose digest ``word`` is (a notice's proof
    that it speaks for the hand-off)."""
    return hmac.compare_digest(
        seal_word(secret).to_bytes(8, "little", signed=True),
        word.to_bytes(8, "little", signed=True),
    )


class Lanes:
    """Work by key, up to ``width`` threads per key, started only while a key
    has work (idle threads block on nothing: they exit). A key whose work
    stalls (a stopped prefill engine) holds up only its own lane."""

    def __init__(self, name: str, width: int) -> None:
        self._name, self._width = name, width
        self._lock = threading.Lock()
        self._queues: dict[str, deque[Callable[[], None]]] = {}
        self._running: dict[str, int] = {}
        self._closed = False

    def submit(self, key: str, work: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                return
            self._queues.setdefault(key, deque()).append(work)
            if self._running.get(key, 0) >= self._width:
                return
            self._running[key] = self._running.get(key, 0) + 1
        threading.Thread(target=self._drain, args=(key,), name=self._name, daemon=True).start()

    def pending(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._queues.values())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._queues.clear()

    def _drain(self, key: str) -> None:
        while True:
            with self._lock:
                queue = self._queues.get(key)
                if not queue:
                    self._queues.pop(key, None)
                    self._running[key] -= 1
                    if not self._running[key]:
                        del self._running[key]
                    return
                work = queue.popleft()
            work()


class Notifier:
    """Sends decode-side notices to prefill ranks, in order, one lane (thread)
    per prefill rank, only while it has notices to send. A notice waits for the
    prefill engine's agent (up to ``NOTICE_TIMEOUT_S``); sent from the read
    threads, notices to one engine that did not answer (stopped, overloaded)
    held those threads, and the reads of every other engine's hand-offs waited
    behind them until their leases ran out. Best effort: the lease frees the
    blocks of a notice that is lost. After a failed notice, the ones queued
    behind it to the same engine are dropped: they would wait as long."""

    def __init__(self) -> None:
        self._lanes = Lanes("raydirect-kv-notices", 1)
        self._lock = threading.Lock()
        self._failed: dict[str, float] = {}  # region -> when its last notice failed

    def send(self, region: rd.RegionHandle, message: dict[str, Any]) -> None:
        queued = time.monotonic()
        self._lanes.submit(region.region, lambda: self._send(region, message, queued))

    def pending(self) -> int:
        return self._lanes.pending()

    def _send(self, region: rd.RegionHandle, message: dict[str, Any], queued: float) -> None:
        with self._lock:
            if self._failed.get(region.region, -1.0) >= queued:
                return  # queued before a failure to that engine: dropped
        try:
            rd.notify_region(region, message, timeout=NOTICE_TIMEOUT_S)
        except Exception as exc:  # its lease frees the blocks anyway
            with self._lock:
                self._failed[region.region] = time.monotonic()
                if len(self._failed) > MAX_NOTICES:
                    self._failed.pop(next(iter(self._failed)))
            logger.info(
                "RaydirectConnector: could not tell a prefill engine (%s) about request %s "
                "(%s), nor the notices queued behind it; its lease frees the blocks",
                region.describe(),
                str(message.get("request", "renewals"))[:200],
                exc,
            )


def status() -> list[dict[str, Any]]:
    """What this process's workers hold and read (tests, debugging)."""
    return [w.status() for w in _workers]
