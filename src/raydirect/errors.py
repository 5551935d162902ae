"""Every error raydirect raises, in one place.

Hierarchy::

    RaydirectError                      base of everything below
    ├── UnknownTransportError (ValueError)
    │       raised by ``rd.method``/``rd.put``/``rd.get`` when a transport name
    │       is not registered; the message lists the known names.
    ├── TransportUnavailableError
    │       raised in a consumer when the transport an object declares cannot
    │       reach it and no fallback applies.
    ├── ProducerLostError
    │       raised in a consumer when the process holding an object's tensors
    │       died, restarted, or no longer holds the object; by ``rd.read_ranges``
    │       and ``rd.notify_region`` when a region's owner closed it or died.
    ├── GroupError
    │       raised when a collective group is misused (an actor in no group for a
    │       two-sided transport) or broken (a transfer failed inside it); the
    │       message names the group and says how to recreate it.
    ├── TransferError
    │       raised in a consumer when bytes failed to move for another reason
    │       (a transport error, a corrupt or truncated reply).
    ├── WeightSyncError
    │       raised by ``WeightPublisher.publish`` (every slot still held past the
    │       timeout, a version that does not increase) and ``WeightSubscriber.load``
    │       (a handle that does not fit the target, refused before a byte moves;
    │       or a transfer that failed midway, the original error chained).
    └── FetchTimeoutError (ray.exceptions.GetTimeoutError, so TimeoutError)
            raised by ``rd.get`` and ``rd.read_ranges`` when their ``timeout`` runs out.

Bad arguments raise the builtins ``TypeError``/``ValueError`` at the call, before
a byte moves (``rd.read_ranges``' rows and destinations, ``rd.export_region``'s
tensors).

``rd.wait_tensor_freed`` raises the builtin ``TimeoutError``.

When Ray itself rebuilds a value (``ray.get`` or a task argument) an error
raised by the fetch reaches the caller wrapped in ``ray.exceptions.RaySystemError``;
its text carries the message below, which says what happened and what to do.
"""

from __future__ import annotations

from collections.abc import Mapping

import ray.exceptions

__all__ = [
    "FetchTimeoutError",
    "GroupError",
    "ProducerLostError",
    "RaydirectError",
    "TransferError",
    "TransportUnavailableError",
    "UnknownTransportError",
    "WeightSyncError",
]


class RaydirectError(Exception):
    """Base class of raydirect's errors."""


class UnknownTransportError(RaydirectError, ValueError):
    """A transport name that is not registered was named.

    Raised by ``rd.method`` wrappers at call time, ``rd.put`` and ``rd.get``.
    """

    def __init__(self, name: object, known: list[str]) -> None:
        self.name = name
        self.known = sorted(known)
        super().__init__(
            f"unknown tensor transport {name!r}; known transports: {', '.join(self.known)}. "
            'Pick one of these ("auto" chooses per pair of processes).'
        )

    def __reduce__(self):  # exceptions with custom __init__ need this to cross processes
        return (type(self), (self.name, self.known))


class TransportUnavailableError(RaydirectError):
    """The consumer cannot use the transport an object needs, and no fallback applies."""


FREED_WHILE_HELD = (
    "freed the object: Ray counted no ref to it left (the process that owned this ref, "
    "the one that made the call or rd.put, died or dropped it)"
)


class ProducerLostError(RaydirectError):
    """The producer of an object died, restarted, or no longer holds the object.

    Raised in a consumer, within a bounded time (never a hang), naming the
    producer. The tensors are gone: re-run the producer method to make them again.
    Raised by ``rd.read_ranges`` and ``rd.notify_region``, naming the region, once
    its owner closed it or died (never stale or foreign bytes instead).
    In the producer, a handler the agent runs raises it when the object was freed
    while the request waited; the agent answers "lost", and the consumer raises it.
    """

    @classmethod
    def of(cls, who: str, what_happened: str) -> ProducerLostError:
        return cls(
            f"the producer {who} {what_happened}; the object's tensors are lost. "
            "Re-run the producer to make them again."
        )

    @classmethod
    def freed_while_held(cls, who: str) -> ProducerLostError:
        """Raised in a consumer whose read found the object freed though it holds
        a ref (``shm``'s tag; ``cma`` and ``cuda_ipc`` say the same through their
        seal, ``ReadSeal``): Ray still hands out a borrowed value whose owner
        died, and that death freed the object (``_caller_leases``)."""
        return cls.of(who, FREED_WHILE_HELD)

    @classmethod
    def by_seal(cls, who: str, extra: Mapping[str, object]) -> ProducerLostError:
        """Raised in a consumer whose check of the object's seal failed (``cma``,
        ``cuda_ipc``: ``ReadSeal``; ``nixl``): what the producer did, from the
        metadata ``extra``: the object's lifetime ended, its region was closed,
        or it was freed while a ref was held."""
        lifetime = extra.get("lifetime")
        if lifetime:
            return cls.of(who, f"freed the object: its lifetime (rd.method({lifetime})) ended")
        if extra.get("region"):
            return cls.of(who, "holds no such region (it was closed)")
        return cls.freed_while_held(who)

    @classmethod
    def of_region(cls, region: str, what_happened: str) -> ProducerLostError:
        """Raised in a reader of ``region`` (``rd.read_ranges``, ``rd.notify_region``)."""
        return cls(
            f"{region} is gone: {what_happened}. Its owner closed it, or died: this handle "
            "reads nothing any more (ask the owner for a new region's handle)"
        )

    @classmethod
    def freed_meanwhile(cls) -> ProducerLostError:
        """In the producer: the object was freed while a request for it waited."""
        return cls("the object was freed while the request waited")


class GroupError(RaydirectError):
    """A collective group is missing, misused, or broken; the message names the fix."""


class TransferError(RaydirectError):
    """Moving an object's bytes failed for a reason other than the producer's loss."""


class WeightSyncError(RaydirectError):
    """Weight sync refused or failed; the message names the tensor and what differs.

    Raised by ``WeightPublisher.publish`` when all ``depth`` slots stay held past
    its ``timeout`` (drop old handles, or raise ``depth``) or the version does not
    increase; by ``WeightSubscriber.load`` before a byte moves when the handle does
    not fit the target (version not newer, names, shapes, dtypes, devices), and
    when a transfer fails midway: then the target may be partly written and
    ``sub.version`` stays where it was (the cause is chained).
    """


class FetchTimeoutError(RaydirectError, ray.exceptions.GetTimeoutError):
    """``rd.get`` or ``rd.read_ranges`` did not finish within its ``timeout``.

    Subclasses ``ray.exceptions.GetTimeoutError`` (and so ``TimeoutError``), so
    code written for ``ray.get(..., timeout=...)`` catches it unchanged. Transfers
    still running are abandoned; their receive buffers are released.
    """
