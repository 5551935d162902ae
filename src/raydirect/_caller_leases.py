"""Caller-owned leases: a direct object's exact lifetime without a subscription
between its producer and the process that called for it.

A lease the producer owns (``_lease``) is nested in a return the caller owns, so
Ray makes the producer subscribe to the caller for each one and publish its
release: measured in blocks, about 0.8-1 ms and 1.5-1.9 ms of CPU per 1 MiB
transfer (docs/benchmarks.md, workload 8). Here the caller owns the lease too.

Per (caller, producer) pair:

- Caller side. Ray runs the invocation decorator of every ``rd.method`` in each
  process that calls it through an actor handle (a handle passed by pickling
  too). It passes a *token* as a hidden keyword argument: a ref the caller owns,
  minted ``_MINTED`` at a time as the returns of one task on the producer
  (``__ray_call__``; its small returns live in the caller's memory store, no
  plasma). The mint is not waited for: a pending ref nests as well as a ready one.
- The producer nests the token in the Payload where its own lease would go and
  notes which object it stands for. Ray counts the token wherever the return
  goes (borrowers, containers, pending tasks, other processes); the caller owns
  it, so its out-of-scope callback fires in the caller.
- The caller sends the ids of freed tokens with its next call to that producer,
  or, after ``_FLUSH_S`` without one, to the producer's agent: never as a Ray
  task, which a busy actor would run only after the method that keeps it busy
  (one waiting in ``rd.wait_tensor_freed`` for this very free, say). A call is
  queued behind such a method as a task is: frees it carries that it has not
  run within ``_CARRIED_S`` go to the agent as well (a free made twice frees
  once).
- The first mint opens the pair: the producer takes a lease of its own (the
  *watch*) and returns it, with its agent's address, nested in a return the
  caller keeps for as long as it lives. When the caller dies, Ray drops its
  borrow, the watch is released and the producer frees every object of the
  pair: the caller owned their refs, so they died with it, as any Ray object
  it owned does.
- Wherever there is no token (a call not made through a handle, a method with
  several returns, a pair this producer incarnation has not opened yet: a
  restarted actor, or a concurrent actor that runs the call before the mint),
  the producer's own lease stands in; so too for every call to an actor with a
  ``max_pending_calls`` limit, whose places a mint would take from the caller's
  own calls until it runs.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from raydirect import _channel, _process, _ray, _runtime, _server, _wire
from raydirect._lease import leases
from raydirect._server import CONTROL, Reply
from raydirect._store import store
from raydirect.errors import ProducerLostError

log = logging.getLogger("raydirect")

TOKEN_KW = "_rd_lease"  # (pair key, token ref)
FREED_KW = "_rd_freed"  # (pair key, [token id, ...])
_MINTED = 64  # tokens per mint
_REFILL_BELOW = 16
# Frees wait at most this long for a call to ride on. Short: a producer that
# waits for a free (``rd.wait_tensor_freed``, workload 8's ``prepare``) idles
# meanwhile, and the transfer after an idle is slower. Measured, workload 8
# at 1/4/16 MiB: 1.74-1.78x / 1.83-2.06x / 2.45-2.93x the two calls with
# 2 ms, 2.82x / 3.28x / 3.85x with 50 ms.
_FLUSH_S = 0.002
# Frees carried on a call that has not run this long go to the agent too: the
# call may wait behind a method that waits for them (a trainer's step in
# rd.wait_tensor_freed, submitted just before the call for its next weights).
_CARRIED_S = 0.01
_ANSWER_S = 10.0  # for the agent's answer to frees sent on their own
_IDLE_S = 1.0  # without frees to send: the sending thread closes its channels
_GIVE_UP_S = 60.0  # frees the producer's agent did not take this long are dropped, logged
_CALLER_GONE = "its caller, which owned its refs, died"


# ---------------------------------------------------------------- producer side


class _Ledger:
    """In the producer: for each open pair, the objects its tokens stand for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pairs: dict[str, dict[str, bytes]] = {}  # key -> token id -> obj id

    def open(self, key: str) -> ray.ObjectRef:
        watch = leases.take(lambda: self._caller_gone(key))
        with self._lock:
            self._pairs.setdefault(key, {})
        return watch

    def claim(self, token_arg: Any, obj_id: bytes) -> ray.ObjectRef | None:
        """The token of ``token_arg`` now stands for ``obj_id``; None when the
        pair is not open here (the caller's own lease is then not used)."""
        try:
            key, token = token_arg
        except (TypeError, ValueError):
            return None
        if not isinstance(token, ray.ObjectRef):
            return None
        with self._lock:
            pair = self._pairs.get(key)
            if pair is None:
                return None
            pair[token.hex()] = obj_id
        return token

    def release(self, freed_arg: Any) -> None:
        """The caller's tokens ``freed_arg`` went out of scope: free their objects."""
        try:
            key, ids = freed_arg
            with self._lock:
                pair = self._pairs.get(key, {})
                objs = [pair.pop(i) for i in ids if i in pair]
        except (TypeError, ValueError):
            return
        for obj_id in objs:
            store.free_later(obj_id)

    def _caller_gone(self, key: str) -> None:
        with self._lock:
            objs = list(self._pairs.pop(key, {}).values())
        for obj_id in objs:
            store.free_later(obj_id, why=_CALLER_GONE)

    def forget_after_fork(self) -> None:
        self._lock = threading.Lock()
        self._pairs.clear()


ledger = _Ledger()


def _mint(actor: Any, key: str, n: int, opening: bool) -> list[Any]:
    """Run in the producer: ``n`` token returns (None each), and on opening one
    more holding the watch and the agent's address, kept by the caller for life."""
    if not opening:
        return [None] * n
    where = [_runtime.agent().address, _ray.node_id(), _process.PID, _process.START_TIME]
    return [None] * n + [[ledger.open(key), *where]]


def _serve_freed(request: dict[str, Any], reply: Reply) -> None:
    """Frees a caller sent on their own (no call to ride on)."""
    ledger.release((request.get("key"), request.get("ids")))
    reply.send({"ok": True})


_server.register(_wire.LEASES_FREED, _serve_freed, needs_object=False, lane=CONTROL)


# ------------------------------------------------------------------ caller side


class _Pair:
    """The caller's state for one producer."""

    def __init__(self) -> None:
        self.key = os.urandom(16).hex()  # also what authorises its frees
        self.tokens: collections.deque[ray.ObjectRef] = collections.deque()
        self.opening: list[ray.ObjectRef] = []  # the opening mint's last return
        self.agent: str | None = None  # the producer's agent, once the opening is back
        self.alive: Callable[[], bool] | None = None  # on this node: is it running
        self.freed: list[str] = []
        self.freed_since = 0.0
        self.carried: dict[int, tuple[float, list[str]]] = {}  # on calls not run yet: since, ids
        self.failing_since: float | None = None  # frees the agent has not taken
        self.minting = threading.Lock()
        self.refused = False  # an actor with a max_pending_calls limit: no mints

    def agent_address(self) -> str | None:
        """The producer's agent; None while the opening mint has not run."""
        if self.agent is None and self.opening:
            ready, _ = ray.wait(self.opening, timeout=0, fetch_local=False)
            if ready:
                watch, self.agent, node, pid, start = ray.get(ready[0])
                self.opening.append(watch)  # held as a ref of its own too
                if node == _ray.node_id():
                    self.alive = lambda: _process.process_alive(pid, start)
        return self.agent


class CallerLeases:
    """In every calling process: tokens per producer, and the frees to send."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pairs: dict[str, _Pair] = {}
        self._session: tuple[int, str] | None = None
        self._wake = threading.Condition(self._lock)
        self._flusher: threading.Thread | None = None
        self._wakes_at = 0.0  # when the flusher's wait ends (inf: none queued); 0: awake
        self._calls = 0  # calls that carried frees, numbering them

    def decorate(self, invocation: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """Ray's invocation decorator of an ``rd.method``."""

        def with_lease(args: Any, kwargs: Any) -> Any:
            handle = _ray.actor_of_invocation(invocation)
            if handle is None:
                return invocation(args, kwargs)
            pair, token, freed = self._before_call(handle)
            kwargs = dict(kwargs or {})
            if token is not None:
                kwargs[TOKEN_KW] = (pair.key, token)
            if freed:
                kwargs[FREED_KW] = (pair.key, freed)
            try:
                refs = invocation(args, kwargs)
            except BaseException:
                self._requeue(pair, freed)
                raise
            if freed:
                self._carried(pair, freed, refs)
            return refs

        return with_lease

    def _before_call(
        self, handle: ray.actor.ActorHandle
    ) -> tuple[_Pair, ray.ObjectRef | None, list[str]]:
        actor_id = _ray.actor_id_of(handle)
        with self._lock:
            session = _ray.session_key()
            if session != self._session:  # tokens of an earlier Ray session are void
                self._pairs.clear()
                self._session = session
            pair = self._pairs.get(actor_id)
            if pair is None:
                pair = self._pairs[actor_id] = _Pair()
                # Under a limit a mint would take one of the caller's own calls' places.
                pair.refused = _ray.max_pending_calls(handle) >= 0
            freed, pair.freed = pair.freed, []
        if len(pair.tokens) < _REFILL_BELOW and not pair.refused:
            # One opening per pair; not under ``_lock``, which Ray's callbacks take
            # (``_freed``) while a submission might wait on Ray's threads.
            with pair.minting:
                if len(pair.tokens) < _REFILL_BELOW:
                    self._mint(pair, handle)
        try:
            token = pair.tokens.popleft()
        except IndexError:  # the mint was refused: the producer's lease stands in
            return pair, None, freed
        key = pair.key
        if not _ray.add_out_of_scope_callback(
            token, lambda _id: self._freed(actor_id, key, _id.hex())
        ):
            return pair, None, freed  # cannot happen while we hold ``token``
        return pair, token, freed

    def _mint(self, pair: _Pair, handle: ray.actor.ActorHandle) -> None:
        opening = not pair.opening
        try:
            refs = _ray.mint_refs_on(handle, _mint, pair.key, _MINTED, opening, n=_MINTED + opening)
        except ray.exceptions.PendingCallsLimitExceeded:
            pair.refused = True
            return
        if opening:
            pair.opening.append(refs.pop())
        pair.tokens.extend(refs)

    def _freed(self, actor_id: str, key: str, token_id: str) -> None:
        """A token went out of scope (on a Ray thread: queue it and return)."""
        with self._lock:
            pair = self._pairs.get(actor_id)
            if pair is None or pair.key != key:  # an earlier session's pair
                return
            if not pair.freed:
                pair.freed_since = time.monotonic()
            pair.freed.append(token_id)
            self._start_flusher()
            self._wake.notify()

    def _carried(self, pair: _Pair, freed: list[str], refs: Any) -> None:
        """``freed`` rides on the call whose returns are ``refs``: kept until the
        call has run, for the flusher to send on its own after ``_CARRIED_S``."""
        first = refs[0] if isinstance(refs, list) and refs else refs
        if not isinstance(first, ray.ObjectRef):  # a generator's: when it runs is unknown
            self._requeue(pair, freed)
            return
        since = time.monotonic()
        with self._lock:
            self._calls += 1
            call = self._calls
            pair.carried[call] = (since, freed)
            self._start_flusher()
            if self._wakes_at > since + _CARRIED_S:  # asleep past this one's due time
                self._wake.notify()
        try:
            _ray.on_ready(first, lambda _error: self._ran(pair, call))
        except Exception:  # the call went out: never fail it; the flusher sends them
            log.debug("raydirect: no ready callback for a call carrying frees", exc_info=True)

    def _ran(self, pair: _Pair, call: int) -> None:
        """The call numbered ``call`` has run, and so made the frees it carried
        (on a Ray thread)."""
        with self._lock:
            pair.carried.pop(call, None)

    def _requeue(self, pair: _Pair, freed: list[str]) -> None:
        if freed:
            with self._lock:
                pair.freed[:0] = freed
                pair.freed_since = time.monotonic()

    def _start_flusher(self) -> None:
        if self._flusher is None or not self._flusher.is_alive():
            # Off any event loop: its ray.get of the opening (ready by then) is
            # no blocking get inside an async actor, whatever Ray would log.
            _ray.quiet_off_loop_get_warning()
            self._flusher = threading.Thread(
                target=self._flush_idle,
                name=f"{_ray.OFF_LOOP_THREAD_PREFIX}-lease-frees",
                daemon=True,
            )
            self._flusher.start()

    def _flush_idle(self) -> None:
        """Send the frees no call carried within ``_FLUSH_S``, and those carried
        on a call that has not run within ``_CARRIED_S``."""
        while True:
            with self._lock:
                due, wait = self._due(time.monotonic())
                if not due:
                    woken = self._sleep(wait if wait is not None else _IDLE_S)
                    if woken or wait is not None:
                        continue
            if due:
                for pair, freed in due:
                    self._send(pair, freed)
                continue
            # Idle: the channels this thread keeps would hold their sockets
            # open, to agents that may die meanwhile, until frees come again.
            _channel.close_cached()
            with self._lock:
                while not any(p.freed or p.carried for p in self._pairs.values()):
                    self._sleep(None)

    def _sleep(self, timeout: float | None) -> bool:
        """Under the lock: the flusher waits ``timeout`` (None: until woken)."""
        self._wakes_at = math.inf if timeout is None else time.monotonic() + timeout
        try:
            return self._wake.wait(timeout)
        finally:
            self._wakes_at = 0.0  # it looks at every pair before it sleeps again

    def _send(self, pair: _Pair, freed: list[str]) -> None:
        """To the producer's agent; queued again if it did not take them."""
        try:
            address = pair.agent_address()
            if address is not None:
                header = {"op": _wire.LEASES_FREED, "key": pair.key, "ids": freed, "reply": True}
                with _channel.channel(address) as ch:
                    ch.producer_alive = pair.alive  # checked while it waits
                    ch.send(header)
                    answer, _ = ch.recv_reply(time.monotonic() + _ANSWER_S, address)
                if answer.get("ok"):
                    pair.failing_since = None
                    return
                why = str(answer.get("error", "refused"))
            else:
                why = "the producer has not run the call that opens the pair"
        except ProducerLostError:
            if pair.agent is not None:
                _channel.forget(pair.agent)
            return  # the producer is gone, and its objects with it
        except ray.exceptions.RayError:
            return  # the opening failed: the producer died before it ran
        except Exception as exc:  # no answer in time, a broken connection
            why = f"{type(exc).__name__}: {exc}"
        now = time.monotonic()
        pair.failing_since = pair.failing_since or now
        if now - pair.failing_since >= _GIVE_UP_S:
            log.warning(
                "raydirect: %d lease free(s) dropped after %.0f s: %s", len(freed), _GIVE_UP_S, why
            )
            pair.failing_since = None
        else:
            self._requeue(pair, freed)

    def _due(self, now: float) -> tuple[list[tuple[_Pair, list[str]]], float | None]:
        """The frees to send now, one list per pair; else how long until the next
        is due (None: none queued)."""
        due: dict[_Pair, list[str]] = {}
        waits: list[float] = []

        def look(pair: _Pair, at: float, ids: list[str]) -> bool:
            if at > now:
                waits.append(at - now)
                return False
            due.setdefault(pair, []).extend(ids)
            return True

        for pair in self._pairs.values():
            if pair.freed and look(pair, pair.freed_since + _FLUSH_S, pair.freed):
                pair.freed = []
            for call, (since, ids) in list(pair.carried.items()):
                if look(pair, since + _CARRIED_S, ids):
                    del pair.carried[call]
        return list(due.items()), min(waits, default=None)

    def forget_after_fork(self) -> None:
        """The pairs belong to the parent's Ray session; its flusher is gone."""
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pairs = {}
        self._session = None
        self._flusher = None
        self._wakes_at = 0.0


caller_leases = CallerLeases()


def decorate(invocation: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """Ray's invocation decorator of an ``rd.method``: a module function, as Ray
    pickles it with the actor class and every handle (by reference, then)."""
    return caller_leases.decorate(invocation)


def _forget_after_fork() -> None:
    caller_leases.forget_after_fork()
    ledger.forget_after_fork()


os.register_at_fork(after_in_child=_forget_after_fork)
