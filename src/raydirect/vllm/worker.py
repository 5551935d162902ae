"""The worker side: every vLLM worker receives its part of a version while its
engine serves, and loads it only once every worker of every engine has.

* ``init_weight_transfer_engine``: join this engine's own Ray cluster, check the
  trainer is in it, find its mailbox (``cluster``); close an update session a
  trainer that died or lost touch left open.
* ``start_weight_update``: nothing to do; the model is not touched yet.
* ``update_weights(info)``: survey the published layout once per layout
  (``landing``: which slice of each tensor this worker reads, what it refuses),
  with every worker of the engine agreeing on the refusals; join the version in
  the mailbox; then receive in the background (``receiving``) while the engine
  keeps stepping. An engine that lost its init (restarted) takes it from ``info``.
* ``finish_weight_update``: the trainer's decision. On commit, load through
  vLLM's layerwise reload (``load``): the only part that stops the engine. On
  abort, drop what was received. Either way vLLM's update session ends.

No RPC here raises on any but the engine's last worker: vLLM's multiprocessing
executor, on a worker's error, leaves the later workers' replies queued for the
next call (every later call would then read the previous one's replies). So
phase-one refusals and phase-two failures go to the trainer through the mailbox,
and an error only this worker can report (a refused init) is gathered from every
worker of the engine and raised by the last one. vLLM's own session checks are
made to raise the same way (``sessions``).
"""

from __future__ import annotations

import logging
import secrets
import sys
import time
from dataclasses import dataclass, field
from typing import Any, cast

import ray
import torch
import torch.distributed as dist

import raydirect as rd
from raydirect.vllm import cluster, sessions
from raydirect.vllm.versions import needed_by

with needed_by("raydirect's weight-transfer backend"):
    from vllm.distributed.parallel_state import get_world_group
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )
    from vllm.model_executor.model_loader.reload.layerwise import (
        _layerwise_process,
        get_layerwise_info,
    )

    from raydirect.vllm.landing import Survey, survey, unread_problems
from raydirect.vllm.mailbox import DROPPED
from raydirect.vllm.receiving import Pending
from raydirect.vllm.staging import Receiver, check_room, staging_bytes

log = logging.getLogger(__name__)
_SHOWN = 5  # refusals listed in one error
_SLACK = 10.0  # seconds for one mailbox call
_DECIDED = 1.0  # seconds a finish waits for the decision's answer, already on its way

Layout = tuple[tuple[str, ...], tuple[str, ...], tuple[tuple[int, ...], ...]]


@dataclass
class RaydirectInitInfo(WeightTransferInitInfo):
    """What trainer rank 0 sends each engine once: its mailbox's name, and the
    trainer's Ray cluster (a node of it) and namespace, for checking."""

    name: str
    namespace: str
    address: str
    node: str = ""
    timeout: float = 300.0


@dataclass
class RaydirectUpdateInfo(WeightTransferUpdateInfo):
    """One update: the version, how many trainer ranks published it, its tensors'
    names, dtypes and global shapes (as vLLM's nccl backend sends them), the
    init info again (``trainer``: an engine that lost its init takes it from
    here), the seconds phase one may take and where the trainer's tensors are."""

    version: int
    ranks: int
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    trainer: dict[str, Any] = field(default_factory=dict)
    seconds: float = 300.0
    device: str = "cpu"
    engine_index: int = -1  # which of the client's engines this is (``clients``)
    keep_staging: bool = True
    host_staging: bool = False


@dataclass
class _Plan:
    """A surveyed layout: the survey, and the refusals every worker agrees on."""

    published: list[tuple[str, torch.dtype, tuple[int, ...]]]
    survey: Survey
    problems: list[str] = field(default_factory=list)


def _layout(info: RaydirectUpdateInfo) -> Layout:
    return tuple(info.names), tuple(info.dtype_names), tuple(map(tuple, info.shapes))


def _world() -> tuple[int, int, Any]:
    """This worker's (rank, size, CPU group) among its engine's workers."""
    try:
        group = get_world_group()
    except AssertionError:  # no parallel state: a model outside an engine
        return 0, 1, None
    return group.rank_in_group, group.world_size, group.cpu_group


def _everyone(value: Any) -> list[Any]:
    """``value`` of every worker of the engine (a collective: every worker runs
    each RPC at once)."""
    _rank, size, group = _world()
    if size == 1:
        return [value]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, value, group=group)
    return out


def _raise_once(what: str, errors: list[str | None]) -> None:
    """Every worker's error of ``what``, raised by the engine's last worker only."""
    said = sorted({f"{e}" for e in errors if e})
    rank, size, _group = _world()
    if said and rank == size - 1:
        raise rd.WeightSyncError(f"raydirect: {what} failed: {'; '.join(said)}")


def _error(exc: BaseException) -> str:
    said = str(exc).removeprefix("raydirect: ")
    return said if isinstance(exc, rd.WeightSyncError) else f"{type(exc).__name__}: {said}"


class RaydirectWeightTransferEngine(WeightTransferEngine[RaydirectInitInfo, RaydirectUpdateInfo]):
    """The worker-side engine of the ``raydirect`` backend (see the module docstring)."""

    init_info_cls = RaydirectInitInfo
    update_info_cls = RaydirectUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._id = secrets.token_hex(8)
        self._trainer: cluster.Trainer | None = None
        self._mailbox: Any = None
        self._plans: dict[Layout, _Plan] = {}
        self._receivers: dict[Layout, Receiver] = {}
        self._pending: Pending | None = None  # the version of the open session
        self._previous: Pending | None = None  # an aborted one maybe still receiving
        self._open = False  # vLLM's update session: started, not yet finished
        self._guarded = False  # vLLM's session checks raise on the last worker alone
        self._keep = True  # the trainer's keep_staging: staging kept between updates
        self._token: Any = None  # this worker's alive token (see ``mailbox``)
        self.last_update: dict[str, Any] = {}  # seconds per phase, bytes received

    # ----------------------------------------------------------------- init

    def init_transfer_engine(self, init_info: RaydirectInitInfo) -> None:
        busy = _everyone(self._busy_for(str(init_info.name)))  # every worker alike
        if any(busy):
            _raise_once("init_weight_transfer_engine", busy)
            return
        error = None
        try:
            self._close_stale_session()
            self._init(dict(vars(init_info)))
        except Exception as exc:
            error = _error(exc)
        _raise_once("init_weight_transfer_engine", _everyone(error))

    def _init(self, fields: dict[str, Any]) -> None:
        if not self._guarded:  # once: finding the worker walks the garbage collector's objects
            self._guarded = True
            rank, size, _group = _world()
            sessions.guard(sessions.vllm_worker_of(self), last=rank == size - 1)
        trainer = cluster.Trainer.of(fields)
        namespace = cluster.join(trainer)
        self._mailbox = cluster.mailbox(trainer, namespace)
        self._trainer = trainer

    def _busy_for(self, name: str) -> str | None:
        """Why trainer ``name`` may not take this engine now: the trainer that
        holds it, alive, is in the middle of an update, from before its first
        call to the engines to after its last (its mailbox says so). Looking only
        at this engine's session missed an init between that trainer's start
        and its update_weights, or between its decision and its finish: the init
        closed the session, and that trainer's next call failed on every worker."""
        trainer, mailbox = self._trainer, self._mailbox
        if trainer is None or trainer.name == name or mailbox is None:
            return None
        try:
            version = ray.get(mailbox.updating.remote(), timeout=_SLACK)
        except Exception:  # its trainer is gone: a session it left open is stale
            return None
        if not version:
            return None
        return (
            f"this engine is in the middle of trainer {trainer.name!r}'s update of version "
            f"{version}: updates of two trainers must not overlap on one engine; "
            "init again once that update has ended"
        )

    def _close_stale_session(self) -> None:
        """A new trainer while an update session is open (its trainer died, or a
        control call failed): vLLM would refuse the next start on every worker.
        The session is closed as vLLM's own ``finish_weight_update`` closes it
        (this engine's part drops what it received)."""
        if not self._open:
            return
        worker = sessions.vllm_worker_of(self)
        if worker is not None:
            log.warning("raydirect: closing an update session left open")
            worker.finish_weight_update()

    # ----------------------------------------------------------------- phase one

    def start_weight_update(self) -> None:
        """Nothing yet: the model is touched only once every worker has received."""
        self._open = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Phase one's start: survey, agree on refusals, join, receive in the
        background. The engine's workers talk to each other only when they must
        agree (a new layout's refusals, an init taken from the update, a bad
        update): every worker's state decides alike, so all of them do or none."""
        try:
            info = self.parse_update_info(update_info)
            key = _layout(info)
            together = self._trainer is None or info.trainer.get("name") != self._trainer.name
            together = together or key not in self._plans
        except Exception as exc:  # the same update on every worker: all fail alike
            self._end_raising([_error(exc)])
            return
        if together:
            error = None
            try:
                if self._trainer is None or info.trainer.get("name") != self._trainer.name:
                    self._init(info.trainer)  # this engine lost its init: restarted
                self._survey(key, info)
            except Exception as exc:
                error = _error(exc)
            said = _everyone((error, self._agreed(key)))
            errors = [e for e, _part in said]
            if any(errors):
                self._end_raising(errors)
                return
            self._agree(key, [part for _e, part in said])
        try:
            self._begin(info, self._plans[key])
        except Exception as exc:  # the mailbox is gone: the trainer misses this worker's join
            log.warning("raydirect: version %s: %s", info.version, _error(exc))
            self._end_raising([_error(exc)])

    def _end_raising(self, errors: list[str | None]) -> None:
        """Raises ``errors`` from the engine's last worker (vLLM ends the session
        of the worker that raises); the others return."""
        rank, size, _group = _world()
        if rank == size - 1 and any(errors):
            self._open = False
            _raise_once("update_weights", errors)

    def receive_weights(self, update_info: RaydirectUpdateInfo) -> None:
        raise rd.WeightSyncError(
            "raydirect receives in update_weights and loads in finish_weight_update: "
            "drive it through vLLM's start/update/finish calls"
        )

    def _survey(self, key: Layout, info: RaydirectUpdateInfo) -> None:
        if key in self._plans:
            return
        published = [
            (n, getattr(torch, d), tuple(s))
            for n, d, s in zip(info.names, info.dtype_names, info.shapes, strict=True)
        ]
        self._plans = {key: _Plan(published, survey(self.model, published))}  # one at a time
        self._receivers = {k: r for k, r in self._receivers.items() if k == key}

    def _agreed(self, key: Layout) -> Any:
        """This worker's part of a new layout's agreement (None if it has no plan)."""
        plan = self._plans.get(key)
        return None if plan is None else (plan.survey.problems, plan.survey.reads)

    def _agree(self, key: Layout, parts: list[Any]) -> None:
        """Every worker's refusals and reads of a new layout (``parts``, gathered
        with the errors), so each refuses what any refuses, and a tensor wider
        than what all of them read together."""
        plan = self._plans[key]
        everyone = [m for m in parts if m is not None]
        problems = sorted({p for ps, _reads in everyone for p in ps})
        shapes = {n: s for n, _d, s in plan.published}
        plan.problems = problems + unread_problems(shapes, [reads for _ps, reads in everyone])

    def _begin(self, info: RaydirectUpdateInfo, plan: _Plan) -> None:
        rank, size, _group = _world()
        who = {
            "engine": self.vllm_config.instance_id,
            "rank": rank,
            "world": size,
            "label": f"engine {self.vllm_config.instance_id} worker {rank}/{size}",
            "index": info.engine_index,
        }
        deadline = time.monotonic() + float(info.seconds)
        refusal = ""
        if plan.problems:
            more = len(plan.problems) - _SHOWN
            refusal = (
                f"version {info.version} does not fit the engine's model: "
                f"{'; '.join(plan.problems[:_SHOWN])}{f' (and {more} more)' if more > 0 else ''}"
            )
        if self._token is None:  # owned by this process: lost when it dies
            self._token = ray.put(self._id)
        join = self._mailbox.join.remote(info.version, self._id, who, [self._token])
        ray.get(join, timeout=_SLACK)
        pending = Pending(info.version, self._id, self._mailbox, deadline, refusal)
        # asked now, answered when rank 0 decides: finish then has it without a call
        pending.decision = self._mailbox.decided.remote(info.version, info.seconds + 3 * _SLACK)
        earlier = [p for p in (self._pending, self._previous) if p is not None and p.running()]
        after = earlier[0] if earlier else None
        key = _layout(info)
        pending.start(lambda: self._receiver(key, plan, info), after)
        self._pending, self._previous = pending, None
        self._keep = bool(info.keep_staging)

    def _receiver(self, key: Layout, plan: _Plan, info: RaydirectUpdateInfo) -> Receiver:
        """This layout's staging (called in phase one's thread): on the engine's
        GPU where the trainer's tensors are on one too, unless ``host_staging``;
        kept from the last update unless the trainer said ``keep_staging=False``,
        else made anew, once it is known to fit."""
        receiver = self._receivers.get(key)
        if receiver is None:
            on_gpu = self.device.type == "cuda"
            to_gpu = on_gpu and info.device == "cuda" and not info.host_staging
            where = self.device if to_gpu else torch.device("cpu")
            check_room(staging_bytes(plan.published, plan.survey), where)
            receiver = Receiver(plan.published, plan.survey, where, pinned=on_gpu)
            self._receivers[key] = receiver
        return receiver

    # ----------------------------------------------------------------- phase two

    def finish_weight_update(self) -> None:
        """Loads on the trainer's commit, drops on its abort; never raises (a
        failure goes to the trainer through the mailbox)."""
        self._open = False
        pending, self._pending = self._pending, None
        if pending is None:
            return
        decision = _decision(pending)
        if decision != "commit" or not pending.finished.is_set() or pending.error:
            self._previous = pending  # its reads may go on: the next update waits for them
            if not decision:  # rank 0 may commit yet, and wait for this worker's load
                why = (
                    f"{DROPPED}its update session was closed before the trainer decided "
                    "(a finish_weight_update that was not the trainer's, e.g. replayed)"
                )
                pending.mailbox.report.remote(pending.version, self._id, "applied", why)
            if not self._keep:  # a receive still running holds its receiver until it ends
                self._receivers.clear()
            return
        error = ""
        started = time.perf_counter()
        try:
            assert pending.receiver is not None
            self._load(pending.receiver)
        except Exception as exc:
            error = f"loading failed ({_error(exc)})"
            log.exception("raydirect: loading version %s failed", pending.version)
        self._mailbox.report.remote(pending.version, self._id, "applied", error)
        self._record(pending, time.perf_counter() - started)
        if not self._keep:  # the memory goes back to the engine until the next update
            self._receivers.clear()

    def _load(self, receiver: Receiver) -> None:
        if not load(self.model, self.model_config, receiver):
            self._receivers.clear()  # the model holds its memory: the next update allocates anew
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def _record(self, pending: Pending, load_s: float) -> None:
        receiver = pending.receiver
        assert receiver is not None
        self.last_update = {
            **self.last_update,
            "version": pending.version,
            "receive_s": pending.received_s,
            "load_s": load_s,
            "bytes": receiver.bytes,
            "landed_bytes": receiver.landed_bytes,
            "relayed_from": pending.relayed_from,
        }
        log.info("raydirect: applied version %s %s", pending.version, self.last_update)

    def shutdown(self) -> None:
        self._receivers.clear()
        self._plans.clear()
        self._mailbox, self._trainer = None, None


def _decision(pending: Pending) -> str:
    """Rank 0's decision on ``pending``'s version, ``""`` if none. Rank 0 has it
    recorded before it calls finish, so the answer asked at the join is here or
    on its way; a finish nobody decided (a call replayed over vLLM's RPC or HTTP,
    an init closing a session) asks the mailbox once and drops the version, where
    it stalled the engine for 10 s waiting for the answer."""
    try:
        try:
            decision = ray.get(pending.decision, timeout=_DECIDED)
        except ray.exceptions.GetTimeoutError:
            decision = ""
        if not decision:
            decision = ray.get(pending.mailbox.decision.remote(pending.version), timeout=_SLACK)
    except Exception as exc:
        log.warning("raydirect: no decision on version %s (%s): dropped", pending.version, exc)
        return ""
    return str(decision)


def _holders(receiver: Receiver) -> list[int]:
    """How many hold each storage the receiver writes (tensors sharing it, a
    detached view in a processed layer's closure) and each tensor it hands the
    loaders (a loader may keep the very tensor it was given)."""
    storages = [torch._C._storage_Use_Count(t.untyped_storage()._cdata) for t in receiver.memory()]
    return storages + [sys.getrefcount(t) for t in receiver.whole.values()]


def load(model: torch.nn.Module, model_config: Any, receiver: Receiver) -> bool:
    """Loads what ``receiver`` received through vLLM's own reload path, as its
    nccl and ipc engines run it, landed layers first. False when the model kept
    some of the receiver's memory (a processed layer that still refers to a
    landed tensor, as vLLM's CPU Zen path without prepacking does, or a loader
    that kept a staging tensor): that memory is the engine's now, and the next
    update must not write it while the engine serves."""
    before = _holders(receiver)
    initialize_layerwise_reload(model)
    try:
        for layer_name, tensors in receiver.landed.items():
            _process_landed(model.get_submodule(layer_name), tensors)
        cast(Any, model).load_weights(receiver.weights())
    finally:
        finalize_layerwise_reload(model, model_config)
    for layer_name in receiver.retie:  # a tied head: processed again from its new values
        layer = model.get_submodule(layer_name)
        method = getattr(layer, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(layer)
    return all(a <= b for a, b in zip(_holders(receiver), before, strict=True))


def _process_landed(layer: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """What vLLM's reload does with a layer once its loaders have run
    (``_layerwise_process``: process, copy into the serving tensors), given the
    layer's tensors as the loaders would have left them."""
    for name, memory in tensors.items():
        stand = getattr(layer, name)  # the reload's meta stand-in: its class, its loader
        tensor = memory.view(memory.shape)
        tensor.__class__ = stand.__class__
        tensor.__dict__ = stand.__dict__.copy()
        setattr(layer, name, tensor)
    _layerwise_process(layer, get_layerwise_info(layer))
