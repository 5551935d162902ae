"""A worker's phase one for one version, in the background while its engine serves.

``Pending.start`` runs in a thread of its own: it waits for the trainer ranks'
handles (the mailbox's ``take``), refuses a version that names a tensor the
engine loads but no rank published, receives every byte this worker needs into
its staging memory (``staging.Receiver``: never memory the engine serves from),
from the ranks or from another engine's worker on this node that received it
first (the relay), and reports to the mailbox. All its waits share the one
deadline the trainer sent. Nothing here touches the model.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

import raydirect as rd
from raydirect.vllm.staging import Receiver

log = logging.getLogger(__name__)
_SLACK = 10.0  # on top of a mailbox wait's own deadline, for the call itself


class Pending:
    """One version this worker takes part in (joined in the mailbox)."""

    def __init__(
        self, version: int, worker: str, mailbox: Any, deadline: float, refusal: str = ""
    ) -> None:
        self.version, self.worker, self.mailbox = version, worker, mailbox
        self.deadline = deadline
        self.error = refusal  # "" while fine; why not, once known
        self.receiver: Receiver | None = None
        self.relayed_from = 0
        self.received_s = 0.0
        self.finished = threading.Event()  # phase one has ended (see ``error``)
        self.decision: Any = None  # a ref: rank 0's decision on this version, once made
        self._thread: threading.Thread | None = None

    def left(self) -> float:
        return max(self.deadline - time.monotonic(), 0.0)

    def start(self, receiver: Callable[[], Receiver], after: Pending | None) -> None:
        """Phase one in a thread; ``receiver()`` gives the staging to receive into
        (called in the thread: a first allocation costs time); ``after``: an
        earlier version still receiving into the same staging, waited for first."""
        if self.error:  # refused before a byte moves
            self._report()
            return
        self._thread = threading.Thread(
            target=self._run, args=(receiver, after), name=f"raydirect-v{self.version}", daemon=True
        )
        self._thread.start()

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self, receiver: Callable[[], Receiver], after: Pending | None) -> None:
        started = time.perf_counter()
        try:
            if after is not None and after._thread is not None:
                after._thread.join(self.left())
                if after.running():
                    raise rd.WeightSyncError(
                        f"this worker was still receiving version {after.version}, which "
                        "was not applied, when the deadline came"
                    )
            handles = self._handles()
            self.receiver = receiver()
            _check_published(self.receiver, handles)
            self._receive(self.receiver, handles)
            del handles  # the trainer's tensors are free to go once no handle is alive
        except Exception as exc:
            self.error = _cause(exc)
            log.warning("raydirect: version %s not received: %s", self.version, self.error)
        self.received_s = time.perf_counter() - started
        self._report()

    def _report(self) -> None:
        self.finished.set()
        try:
            self.mailbox.report.remote(self.version, self.worker, "received", self.error)
        except Exception as exc:  # the trainer is gone: nothing will load this version
            log.warning("raydirect: could not report version %s: %s", self.version, exc)

    def _handles(self) -> list[Any]:
        try:
            got = self.mailbox.take.remote(self.version, self.left())
            return list(ray.get(got, timeout=self.left() + _SLACK))
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if exc.cause is not None else exc
            raise rd.WeightSyncError(str(cause)) from None
        except ray.exceptions.RayActorError:
            raise rd.WeightSyncError("the trainer's mailbox is gone: trainer rank 0 died") from None

    def _receive(self, receiver: Receiver, handles: list[Any]) -> None:
        """From the ranks, or from the worker of another engine on this node that
        reads the same and received it first (the relay): across nodes the
        trainer then sends each byte once per node, not once per engine."""
        version, mailbox = self.version, self.mailbox
        key = f"{ray.get_runtime_context().get_node_id()} {receiver.key}"
        if ray.get(mailbox.lead.remote(version, key), timeout=self.left() + _SLACK):
            try:
                receiver.receive(handles, self.left())
            except BaseException:
                mailbox.relayed.remote(version, key, [""])
                raise
            mailbox.relayed.remote(version, key, [receiver.relay(version)])
            return
        asked = mailbox.relay.remote(version, key, self.left())
        relay = ray.get(asked, timeout=self.left() + _SLACK)
        if relay is not None:
            try:
                receiver.receive([relay], self.left())
                self.relayed_from = 1
                return
            except rd.WeightSyncError as exc:  # the relay's worker went: the ranks
                log.warning("raydirect: relay of version %s failed (%s)", version, exc)
        receiver.receive(handles, self.left())


def _check_published(receiver: Receiver, handles: list[Any]) -> None:
    """A tensor the engine loads that no rank published would load from staging
    that nothing wrote: refused before a byte moves."""
    published = {name for h in handles for name in h.names}
    missing = sorted(set(receiver.staged) - published)
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5])
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise rd.WeightSyncError(
            f"the update lists {shown}{more}, which the engine loads, but no trainer rank "
            "published it"
        )


def _cause(exc: BaseException) -> str:
    said = str(exc).removeprefix("raydirect: ")
    return said if isinstance(exc, rd.WeightSyncError) else f"{type(exc).__name__}: {said}"
