"""Read notices: a one-sided read's "sent" notice to its producer, off the reader's path.

A one-sided read (``cma``, ``cuda_ipc``, ``nixl``) happens without the
producer's agent, which counts it (``bytes_sent``, ``objects_sent``) only when
the consumer says so. Sent from the reader's own thread, that notice cost
0.35-0.7 ms of every medium transfer here (a socket send, at times a CURVE
handshake on a new thread); now the reader queues it and returns, and one
thread per process sends the queue, in batches, to each producer.

No notice is lost while its producer lives: each batch asks for an answer, and
a batch the agent refuses as busy (its admission is full) is sent again, with
a growing pause, for up to ``_GIVE_UP_S``. A producer that is gone takes its
counts with it: its notices are dropped, and its channel closed. How soon
counts settle: the thread sends once reads pause for 2 ms (at most 20 ms
after the first waiting), so 2-20 ms and a round trip after the read on an
idle machine, seconds under a flood of requests to the producer; ``settle``
sends at once and waits for this process's.
An exiting process waits up to ``_EXIT_WAIT_S`` for its notices.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from raydirect import _channel, _process, _wire
from raydirect.errors import ProducerLostError

log = logging.getLogger("raydirect")

_QUEUED_MAX = 1 << 16  # reads waiting; a reader past it waits (never drops one)
_BATCH = 512  # reads per message: a message stays well under the agent's 1 MiB
_ANSWER_S = 10.0  # for a batch's answer; then it is sent again
_GIVE_UP_S = 60.0  # a producer busy (or silent) this long: its notices are dropped, logged
_PAUSE_S = (0.005, 0.5)  # between tries at a busy producer: first, most
_EXIT_WAIT_S = 0.5
# Sent once reads have paused this long, or this long after the first waiting
# one: the reader's process runs one Python thread at a time, and a notice sent
# while its reader still works cost that reader 0.3-0.4 ms of GIL per transfer
# here (then a batch rides on one message too).
_QUIET_S = 0.002
_LINGER_S = 0.02
# Nor is the thread woken by each read: while reads come, it looks every
# _LINGER_S; after _AWAKE_S without one it sleeps until the next read.
_AWAKE_S = 1.0


@dataclass
class _Producer:
    """Reads waiting for one producer's agent, and how to tell it is gone."""

    address: str
    pid: int  # 0: on another node (its pid says nothing here)
    start_time: int
    reads: list[list[Any]] = field(default_factory=list)
    first_try: float | None = None  # of the batch now failing, for _GIVE_UP_S
    not_before: float = 0.0  # a busy producer's pause

    def alive(self) -> bool:
        return self.pid == 0 or _process.process_alive(self.pid, self.start_time)


class Notices:
    """This process's queue of read notices and the thread that sends it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: dict[str, _Producer] = {}
        self._unsettled = 0  # reads posted and not yet answered (or dropped)
        self._thread: threading.Thread | None = None
        self._last_post = 0.0
        self._first_post: float | None = None  # of the reads waiting, unsent
        self._hurry = 0  # callers of settle waiting: send at once
        self._asleep = False  # the thread waits for a read to wake it

    def post(self, address: str, pid: int, start_time: int, read: list[Any]) -> None:
        """Queue one read's notice (``[obj, cap, transport, nbytes, total]``) for the
        agent at ``address``; ``pid``, ``start_time``: the producer's, or 0 when it is
        on another node. Returns at once unless ``_QUEUED_MAX`` reads already wait."""
        with self._cond:
            while self._unsettled >= _QUEUED_MAX:
                self._cond.wait(0.1)
            producer = self._waiting.get(address)
            if producer is None:
                producer = self._waiting[address] = _Producer(address, pid, start_time)
            producer.reads.append(read)
            self._unsettled += 1
            self._last_post = time.monotonic()
            if self._first_post is None:
                self._first_post = self._last_post
            if self._asleep:
                self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._send_forever, name="raydirect-notices", daemon=True
                )
                self._thread.start()

    def settle(self, timeout: float | None) -> bool:
        """Wait until every notice posted so far is counted by its producer (or
        dropped, its producer gone); False if some still wait at ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._hurry += 1
            self._cond.notify_all()
            try:
                while self._unsettled:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    self._cond.wait(remaining)
            finally:
                self._hurry -= 1
        return True

    def _send_forever(self) -> None:
        connected = False  # channels to producers may be cached since the last close
        while True:
            with self._cond:
                batches = self._next_batches(connected)
            if batches is None:
                # Idle: hold no sockets to producers meanwhile. Closing them lets
                # the GIL go: under the lock, a read posting then waited for it.
                _channel.close_cached()
                connected = False
                continue
            connected = True
            for producer, batch in batches:
                settled = self._deliver(producer, batch)
                with self._cond:
                    if not settled:  # back to the front, in order
                        producer.reads[:0] = batch
                    else:
                        self._unsettled -= len(batch)
                    if not producer.reads and settled:
                        self._waiting.pop(producer.address, None)
                    self._cond.notify_all()

    def _next_batches(self, connected: bool) -> list[tuple[_Producer, list[list[Any]]]] | None:
        """Under the lock: wait for reads to send, and take them off their queues;
        None when the thread goes idle with channels still ``connected`` (to close
        outside the lock)."""
        while not self._ready():
            pause = self._pause()
            if pause is None and connected:
                return None
            self._asleep = pause is None
            self._cond.wait(pause)
            self._asleep = False
        now = time.monotonic()
        due = [p for p in self._waiting.values() if p.reads and p.not_before <= now]
        batches = [(p, p.reads[:_BATCH]) for p in due]
        for p, batch in batches:
            del p.reads[: len(batch)]
        return batches

    def _ready(self) -> bool:
        now = time.monotonic()
        first = self._first_post
        lingering = first is not None and now - first < _LINGER_S
        if lingering and not self._hurry and now - self._last_post < _QUIET_S:
            return False  # the reader may still be at work
        ready = any(p.reads and p.not_before <= now for p in self._waiting.values())
        if ready:
            self._first_post = None
        return ready

    def _pause(self) -> float | None:
        """How long to wait before looking again; None: until a read wakes us."""
        now = time.monotonic()
        later = [p.not_before for p in self._waiting.values() if p.reads and p.not_before > now]
        if self._first_post is not None:
            later.append(min(self._last_post + _QUIET_S, self._first_post + _LINGER_S))
        if later:
            return max(0.0, min(later) - now)
        return _LINGER_S if now - self._last_post < _AWAKE_S else None

    def _deliver(self, producer: _Producer, batch: list[list[Any]]) -> bool:
        """Send one batch and wait for its answer: True once it is counted, or
        dropped for good (producer gone, or busy past ``_GIVE_UP_S``)."""
        now = time.monotonic()
        if producer.first_try is None:
            producer.first_try = now
        header = {"op": _wire.SENT, "reads": batch, "reply": True}
        who = producer.address
        try:
            if not producer.alive():
                raise ProducerLostError.of(who, "is no longer running")
            with _channel.channel(producer.address) as ch:
                if producer.pid:
                    ch.producer_alive = producer.alive
                ch.send(header)
                ch.wait_readable(now + _ANSWER_S, who)
                answer = _wire.decode_header(ch.socket.recv(), who)
        except ProducerLostError:
            producer.first_try = None
            return True  # its counts went with it
        except Exception as exc:  # no answer in time, a broken connection: send again
            return self._again(producer, batch, f"{type(exc).__name__}: {exc}")
        if answer.get("ok") or answer.get("kind") != _wire.BUSY:
            producer.first_try, producer.not_before = None, 0.0
            return True
        return self._again(producer, batch, str(answer.get("error", "busy")))

    @staticmethod
    def _again(producer: _Producer, batch: list[list[Any]], why: str) -> bool:
        """Pause before the next try at ``producer``; False (keep the batch) unless
        it has failed for ``_GIVE_UP_S``."""
        first = producer.first_try or time.monotonic()
        if time.monotonic() - first >= _GIVE_UP_S:
            log.warning(
                "raydirect: %d read notice(s) to %s dropped after %.0f s: %s",
                len(batch),
                producer.address,
                _GIVE_UP_S,
                why,
            )
            producer.first_try, producer.not_before = None, 0.0
            return True
        low, high = _PAUSE_S
        waited = time.monotonic() - first
        producer.not_before = time.monotonic() + min(high, max(low, waited))
        return False


notices = Notices()


def _at_exit() -> None:
    notices.settle(_EXIT_WAIT_S)


atexit.register(_at_exit)


def _forget_after_fork() -> None:
    # The parent's reads are the parent's to report; its sending thread is gone.
    global notices
    _process.keep_from_parent(notices)
    notices = Notices()


os.register_at_fork(after_in_child=_forget_after_fork)
