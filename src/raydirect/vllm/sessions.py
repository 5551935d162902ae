"""vLLM's own update-session checks, refused by an engine's last worker alone.

vLLM 0.32's worker raises, before it changes anything, on a call that does not
match its update session: ``start_weight_update`` (or the draft one) while one
is open, ``update_weights`` or ``finish_weight_update`` without one. Every
worker of an engine raises alike, and vLLM's multiprocessing executor reads the
replies worker by worker and stops at the first error: the later workers'
replies stay queued, and every later call to that engine reads the reply of
the call before (a trainer's next init got the old refusal). One stray call (a
finish replayed over HTTP, a client retrying a call that had landed) left a
tensor-parallel engine unusable until restarted.

So on an engine of this backend only the last worker raises for such a call,
with vLLM's own error; the others return, changing nothing either. The caller
gets the refusal and the engine serves the next call, as every error of this
backend is raised (``worker``). The check is vLLM's session flag, read before
vLLM's method runs; the method itself is vLLM's, unchanged. A start refused
because a session is open says so in raydirect's words too (``SESSION_OPEN``):
a trainer reads another trainer's update in progress from that, which the
worker took from the flag, whatever vLLM's error says.
"""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Callable
from typing import Any

import raydirect as rd
from raydirect.vllm.versions import SUPPORTED, installed

log = logging.getLogger(__name__)

_GUARDED = "_raydirect_session_guard"
# The last worker's refusal of a start while a session is open, read from vLLM's
# session flag (the trainer tells another trainer's open update by it, not by
# vLLM's wording of its error).
SESSION_OPEN = "an update session is already open on this engine"


def _active(worker: Any) -> bool:
    return bool(getattr(worker, "_weight_update_active", False))


def _draft_refused(worker: Any) -> bool:
    engine = getattr(worker, "weight_transfer_engine", None)
    return _active(worker) or not getattr(engine, "supports_draft_weight_update", False)


# What vLLM refuses on every worker, by method: a session open, or none.
_REFUSED: dict[str, Callable[[Any], bool]] = {
    "start_weight_update": _active,
    "start_draft_weight_update": _draft_refused,
    "update_weights": lambda worker: not _active(worker),
    "finish_weight_update": lambda worker: not _active(worker),
}


def vllm_worker_of(engine: Any) -> Any:
    """The vLLM worker whose ``weight_transfer_engine`` is ``engine``, or None
    (vLLM hands an engine no reference to its worker)."""
    for holder in gc.get_referrers(engine):
        if isinstance(holder, dict) and holder.get("weight_transfer_engine") is engine:
            for worker in gc.get_referrers(holder):
                if getattr(worker, "__dict__", None) is holder and hasattr(
                    worker, "finish_weight_update"
                ):
                    return worker
    return None


def guard(worker: Any, last: bool) -> None:
    """Has ``worker`` (``last``: the engine's last worker) refuse a call that does
    not match its session as described above. Once per worker. Raises
    ``rd.WeightSyncError`` naming the supported vLLM range where this vLLM's worker
    is not found or keeps no session flag: a guard that did nothing there left a
    TP engine reading its previous call's replies after one stray call."""
    if worker is None or not hasattr(worker, "_weight_update_active"):
        what = (
            "no vLLM worker holds this engine"
            if worker is None
            else (f"vLLM's {type(worker).__name__} has no _weight_update_active")
        )
        raise rd.WeightSyncError(
            f"{what}: raydirect's weight backend needs vLLM {SUPPORTED}'s worker "
            f"(this is vLLM {installed()}); install a supported vLLM"
        )
    if getattr(worker, _GUARDED, False):
        return
    for name, refused in _REFUSED.items():
        method = getattr(worker, name, None)
        if method is not None:
            setattr(worker, name, _guarded(worker, name, method, refused, last))
    setattr(worker, _GUARDED, True)


def _guarded(
    worker: Any, name: str, method: Callable[..., Any], refused: Callable[[Any], bool], last: bool
) -> Callable[..., Any]:
    opens = name == "start_weight_update"

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not refused(worker):
            return method(*args, **kwargs)
        if not last:
            log.warning(
                "raydirect: %s does not match this worker's update session: vLLM refuses it; "
                "the engine's last worker raises its error, this one changes nothing",
                name,
            )
            return None
        try:
            return method(*args, **kwargs)  # vLLM's own refusal
        except Exception as exc:
            if not opens:
                raise
            raise rd.WeightSyncError(f"raydirect: {SESSION_OPEN}: {exc}") from exc

    return call
