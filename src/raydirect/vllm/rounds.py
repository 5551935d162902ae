"""Rank 0's round trip with the engines for one version: two phases, all or nothing.

1. ``start_weight_update`` then ``update_weights(info)`` on every engine. Each
   worker joins the version in the mailbox before that RPC returns, then
   receives in the background while its engine keeps serving: the bytes go into
   staging memory of its own, every check runs, no serving tensor is touched.
   Rank 0 waits for every joined worker's report.
2. Only if every worker of every engine received does rank 0 decide *commit*;
   otherwise *abort*. Either way it calls ``finish_weight_update`` on every
   engine (with the new weight version only on commit), which closes every
   engine's vLLM update session: a committing worker loads there (the only part
   that stops its engine), an aborting one drops what it received.

Every client call is bounded by the update's deadline (a call that does not
return in time is named, with its phase); a part of the deadline is kept for
closing the sessions after a phase one that ran out of time.

vLLM's own calls raise on a worker whose session state does not match (start
while one is open, finish without one), and its multiprocessing executor then
leaves the other workers' replies queued for the next call. So rank 0 never
calls ``update_weights`` after a failed start, and after any failed control call
it initialises the engines again before the next update: a worker then closes a
session left open (see ``worker``). Where an engine has several workers it
initialises them before every update: a worker's init refuses another trainer's
update in progress from the engine's last worker alone, where a start would be
refused by every worker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from vllm.distributed.weight_transfer.base import ParamMeta, VLLMWeightSyncClient

import raydirect as rd
from raydirect.vllm import clients
from raydirect.vllm.mailbox import DROPPED
from raydirect.vllm.sessions import SESSION_OPEN

log = logging.getLogger(__name__)
_SHOWN = 5  # problems listed in one message
_SLACK = 10.0  # on top of a mailbox wait's own deadline, for the call itself


def reserve_for_closing(timeout: float) -> float:
    """The part of an update's deadline kept for closing the sessions."""
    return min(10.0, 0.25 * timeout)


@dataclass
class Round:
    """What rank 0 keeps between versions to drive the engines."""

    client: VLLMWeightSyncClient
    mailbox: Any
    trainer: dict[str, Any]  # the init info: how a worker finds and checks the mailbox
    timeout: float
    ranks: int  # trainer ranks that publish each version
    dtype: str | None  # what floating-point tensors are published as, if cast
    staging: dict[str, bool]  # keep_staging, host_staging: how the workers stage
    suspect: bool = False  # a control call failed: an engine may hold an open session
    widest: int = 0  # most workers of one engine in the last update (0: not known)

    @classmethod
    def at_init(cls, client: VLLMWeightSyncClient, mailbox: Any, info: Any, ranks: int) -> Round:
        """Initialises every engine's workers for this trainer (``info``: its
        ``RaydirectTrainerInitInfo``; ``ranks``: how many publish); raises
        ``rd.WeightSyncError`` naming why not."""
        context = ray.get_runtime_context()
        trainer = {
            "name": info.name,
            "namespace": context.namespace,
            "address": context.gcs_address,
            "node": context.get_node_id(),
            "timeout": float(info.timeout),
        }
        staging = {"keep_staging": info.keep_staging, "host_staging": info.host_staging}
        made = cls(client, mailbox, trainer, float(info.timeout), ranks, info.dtype, staging)
        deadline = time.monotonic() + made.timeout
        try:
            _call(client.init_weight_transfer_engine, (trainer,), "init", deadline)
        except Exception as exc:
            raise rd.WeightSyncError(
                f"raydirect: the engines refused this trainer: {_said(exc)}"
            ) from exc
        return made


def drive(
    round_: Round, version: int, meta: list[ParamMeta], devices: set[str], deadline: float
) -> str:
    """One version's round trip; ``""`` if every engine applied it, else what
    went wrong and what the engines hold now."""
    dtype = round_.dtype
    update: dict[str, Any] = {
        "version": version,
        "ranks": round_.ranks,
        "names": [m.name for m in meta],
        "dtype_names": [
            dtype if dtype and m.dtype.is_floating_point else str(m.dtype).removeprefix("torch.")
            for m in meta
        ],
        "shapes": [list(m.shape) for m in meta],
        "trainer": round_.trainer,
        "device": "cuda" if "cuda" in devices else "cpu",
        **round_.staging,
    }
    phase_end = deadline - reserve_for_closing(round_.timeout)
    problems: list[str] = []
    started = _open_sessions(round_, update, phase_end, problems)
    mailbox = round_.mailbox
    if not problems:  # else it is an abort already: the workers still receiving drop it
        wait = max(phase_end - time.monotonic(), 0.0)
        first = ray.get(mailbox.reports.remote(version, "received", wait), timeout=wait + _SLACK)
        round_.widest = max((int(w.get("world", 1)) for w in first["workers"].values()), default=0)
        problems += _unjoined(first)
        problems += _unreported(first, "receive", update.get("seconds", 0.0))
        problems += _reported(first)
    commit = not problems
    _decide(mailbox, version, commit)
    if not started:
        return _not_applied(version, problems)
    if not commit:
        _close_sessions(round_, None, deadline, problems, commit=False)
        return _not_applied(version, problems)
    engines = clients.engines_of(round_.client)
    weight_version = None if engines else str(version)  # else set per engine below
    closed = _close_sessions(round_, weight_version, deadline, problems, commit=True)
    wait = max(deadline - time.monotonic(), 0.0)
    second = ray.get(mailbox.reports.remote(version, "applied", wait), timeout=wait + _SLACK)
    if not closed and _nothing_loaded(second):
        return _not_applied(version, problems + _reported(second))
    held = clients.held_by_index(second, engines) if engines else None
    if held is not None:
        try:
            clients.set_versions(round_.client, held, str(version), _SLACK)
        except Exception as exc:
            problems.append(f"update_weight_version failed: {_said(exc)}")
    failed = _reported(second) + (_unreported(second, "load", 0.0) if closed else problems)
    if failed:
        return _partly_applied(version, failed, held)
    return _unversioned(version, problems) if problems else ""


def _decide(mailbox: Any, version: int, commit: bool) -> None:
    """Records the decision (each worker asked for it as it joined) before any
    finish: a worker's finish waits for its answer only briefly, so that one
    nobody decided (a replayed call) does not stall the engine."""
    try:
        ray.get(mailbox.decide.remote(version, commit), timeout=_SLACK)
    except Exception as exc:  # the workers' finish then drops the version
        log.warning("raydirect: recording the decision on version %s failed: %s", version, exc)


def _open_sessions(
    round_: Round, update: dict[str, Any], phase_end: float, problems: list[str]
) -> bool:
    """Phase one's calls; False if no session was opened, or if an engine's
    start was refused because another caller's session is open there (a start
    that fails otherwise on one engine may have opened the others: True then)."""
    client = round_.client
    # An init first after a failed call (a worker then closes a session the call
    # left open) and where an engine may have several workers: each of them
    # refuses a start while another trainer's session is open, and vLLM's
    # executor reads the first refusal only, leaving the others' replies queued
    # (every later call on that engine then read the previous call's replies,
    # the other trainer's finish too). The init refuses the overlap from the
    # engine's last worker alone.
    if round_.suspect or round_.widest != 1:
        try:
            _call(client.init_weight_transfer_engine, (round_.trainer,), "init", phase_end)
            round_.suspect = False
        except Exception as exc:
            problems.append(f"init_weight_transfer_engine failed: {_said(exc)}")
            return False
    try:
        _call(client.start_weight_update, (), "start_weight_update", phase_end)
    except Exception as exc:
        round_.suspect = True
        said = _said(exc)
        if SESSION_OPEN not in said:
            problems.append(said)
            return True
        # Another caller's session is open there: finishing it would end that
        # update (its trainer then waited out its deadline and reported a load
        # that never ran). The sessions this start opened elsewhere are closed now.
        problems.append(
            f"{said} (an engine is in another update session: another trainer's update "
            "is in progress there; updates of two trainers must not overlap on one engine)"
        )
        _close_own_sessions(round_, phase_end)
        return False
    try:
        update["seconds"] = max(phase_end - time.monotonic(), 0.0)
        _call(clients.update_each, (client, update), "update_weights", phase_end)
    except Exception as exc:
        round_.suspect = True
        problems.append(_said(exc))
    return True


def _close_own_sessions(round_: Round, end: float) -> None:
    """After a start refused on an engine where another trainer's update is open:
    closes the sessions this start opened on the other engines, which would
    refuse every other trainer's start until this one's next update. An init
    does it (a worker closes an open session unless another trainer's update is
    under way), and leaves the busy engines' sessions alone: it refuses
    this trainer there. Not ``finish_weight_update``, which ends every engine's
    session, the other trainer's too."""
    try:
        _call(round_.client.init_weight_transfer_engine, (round_.trainer,), "init", end)
    except Exception as exc:  # the busy engines refuse it, as they should
        log.info("raydirect: init after an overlapping start: %s", _said(exc))


def _close_sessions(
    round_: Round, weight_version: str | None, deadline: float, problems: list[str], commit: bool
) -> bool:
    """``finish_weight_update`` on every engine (with ``weight_version`` where the
    client sets it), which loads on a commit. False if the call failed or did not
    return in time (on an abort that is no news: an engine whose worker raised
    in phase one has ended that worker's session already, and vLLM refuses to
    finish it again)."""
    try:
        _call(round_.client.finish_weight_update, (weight_version,), "finish", deadline)
        return True
    except Exception as exc:
        round_.suspect = True
        if commit:
            problems.append(_said(exc))
        else:
            log.info("raydirect: finish_weight_update after an abort: %s", _said(exc))
        return False


def _call(fn: Callable[..., Any], args: tuple[Any, ...], what: str, deadline: float) -> None:
    """``fn(*args)`` (a client call), raising ``TimeoutError`` naming ``what``
    if it has not returned by ``deadline``; the call itself cannot be cancelled
    and goes on in its thread."""
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            fn(*args)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, name=f"raydirect-vllm-{what}", daemon=True)
    thread.start()
    thread.join(max(deadline - time.monotonic(), 0.0))
    if thread.is_alive():
        raise TimeoutError(
            f"the engines' {what} call did not return within the update's deadline "
            "(RaydirectTrainerInitInfo.timeout): an engine does not answer"
        )
    if outcome:
        raise outcome[0]


def _said(exc: BaseException) -> str:
    """What an engine's error says: a worker's error arrives wrapped by vLLM's RPC
    and Ray (or in an HTTP answer), its raydirect line is the one to show."""
    said = str(exc).strip().splitlines()
    body = getattr(getattr(exc, "response", None), "text", None)
    if isinstance(body, str):
        said += body.replace("\\n", "\n").splitlines()
    last = said[-1] if said else ""
    cause = next((line for line in reversed(said) if "raydirect" in line), last)
    return f"{type(exc).__name__}: {cause.strip()}"


def _grouped(workers: dict[str, dict[str, Any]], errors: dict[str, str]) -> list[str]:
    """One line per distinct error, naming the workers that said it."""
    by_error: dict[str, list[str]] = defaultdict(list)
    for worker, error in errors.items():
        by_error[error].append(str(workers.get(worker, {}).get("label", worker)))
    return [f"{', '.join(sorted(labels))}: {error}" for error, labels in by_error.items()]


def _unjoined(reports: dict[str, Any]) -> list[str]:
    """Engines some of whose workers did not join (each worker joins inside the
    update_weights RPC, which returned on every engine): one that could not
    reach the mailbox logged why, and may not raise (see ``worker``)."""
    engines: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for who in reports["workers"].values():
        engines[str(who.get("engine"))].append(who)
    problems = []
    for engine, workers in sorted(engines.items()):
        world = int(workers[0].get("world", 1))
        missing = sorted(set(range(world)) - {int(w.get("rank", 0)) for w in workers})
        if missing:
            problems.append(
                f"engine {engine}: worker(s) {missing} of {world} did not join version "
                "(see those workers' logs)"
            )
    return problems


def _reported(reports: dict[str, Any]) -> list[str]:
    said = {w: e for w, e in reports["said"].items() if e}
    return _grouped(reports["workers"], said)


def _unreported(reports: dict[str, Any], phase: str, seconds: float) -> list[str]:
    """The workers that did not report ``phase``: those that died (their alive
    token is lost: found within seconds), then those that did not finish in time."""
    died = set(reports.get("died", ()))
    gone = {w: "" for w in reports["workers"] if w in died}
    missing = {w: "" for w in reports["workers"] if w not in reports["said"] and w not in died}
    within = f" within {seconds:.1f} s" if seconds else ""
    return [
        f"{line.rstrip(': ')} died during the {phase} phase (its process is gone: "
        "restart that engine)"
        for line in _grouped(reports["workers"], gone)
    ] + [
        f"{line.rstrip(': ')} did not finish the {phase} phase{within}"
        for line in _grouped(reports["workers"], missing)
    ]


def _nothing_loaded(reports: dict[str, Any]) -> bool:
    """Every joined worker said it loaded nothing: a finish that was not the
    trainer's closed its session before the decision (see ``worker``)."""
    said = reports["said"]
    return said.keys() >= reports["workers"].keys() and all(
        error.startswith(DROPPED) for error in said.values()
    )


def _listed(problems: list[str]) -> str:
    more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
    return "; ".join(problems[:_SHOWN]) + more


def _not_applied(version: int, problems: list[str]) -> str:
    return (
        f"version {version} was not applied: {_listed(problems)}. No engine loaded it: "
        "the engines keep serving the weights they held before this update, and their "
        "weight version is unchanged"
    )


def _partly_applied(version: int, failed: list[str], held: list[bool] | None) -> str:
    return (
        f"version {version} was committed, but loading it failed: {_listed(failed)}. "
        "The engines named hold a mix of their previous weights and version "
        f"{version} (the layers loaded before the failure hold version {version}); "
        f"every other engine applied it. {_versions(version, held)}. The next update "
        "loads every layer again"
    )


def _unversioned(version: int, problems: list[str]) -> str:
    return (
        f"version {version} was applied by every engine, but setting their weight "
        f"version failed: {_listed(problems)}. They serve version {version}; "
        "get_weight_version() may report the one before"
    )


def _versions(version: int, held: list[bool] | None) -> str:
    """Which engines report which weight version after a partial phase two."""
    if held is None:  # the client's own finish: it sets the versions as it does
        return (
            "Their weight versions are as the client's finish_weight_update left "
            "them: read each engine's get_weight_version()"
        )
    applied = [i for i, ok in enumerate(held) if ok]
    mixed = [i for i, ok in enumerate(held) if not ok]
    return (
        f"Of the client's engines (in its handles' order), {applied or 'none'} report "
        f"weight version {version}; {mixed} keep reporting the version they had"
    )
