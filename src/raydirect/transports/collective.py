"""Two-sided transports over a collective group: the shared logic of gloo and nccl.

The consumer asks the producer's agent to send to its rank; the agent checks
the request, answers at once, then sends while the consumer receives. Receives
are posted only after that answer, so a refused request leaves the group
intact. Each transfer has its own tag, so concurrent transfers between one
pair cannot cross; where the backend ignores tags (NCCL), transfers between a
pair are serialised on both sides instead.

A receive that fails or times out leaves a torch process group unusable
(measured with Gloo: the next collective fails on both ranks), so any failure
inside a transfer marks the group broken in every member.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from raydirect import _groups
from raydirect._channel import channel
from raydirect._ranges import Ranges
from raydirect.errors import GroupError, TransportUnavailableError
from raydirect.transports.base import (
    ByteTransport,
    Delivered,
    PeerMetadata,
    TensorTransportMetadata,
)

if TYPE_CHECKING:
    from raydirect._server import Reply
    from raydirect._store import StoredObject


class CollectiveTransport(ByteTransport):
    one_sided = False
    # Backends that ignore tags need transfers between a pair kept in one order.
    serialize_pairs: ClassVar[bool] = False

    @staticmethod
    def make_process_group(
        store: Any, rank: int, world: int, timeout: datetime.timedelta, host: str
    ) -> Any:
        """A standalone process group of this backend over ``store``; ``host`` is
        this node's Ray address, for backends that bind to one."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Make completed work visible to the host (a no-op for CPU backends)."""

    # ---- producer side
    def extract_tensor_transport_metadata(
        self, obj_id: bytes, tensors: list[torch.Tensor]
    ) -> TensorTransportMetadata:
        mine = _groups.local_groups(self.name)
        groups = {n: [g.generation, g.rank] for n, g in mine.items() if not g.broken}
        if not groups:
            for group in mine.values():
                group.check_usable()  # a broken group: say which, and how to recreate it
            raise GroupError(
                f"tensor_transport={self.name!r} needs the producer to be in a {self.name} "
                f"group: call rd.create_collective_group([producer, consumer, ...], "
                f"backend={self.name!r}) first, or use tensor_transport='auto'"
            )
        return TensorTransportMetadata(tensor_meta=[], extra={"groups": groups})

    def serve(
        self, obj: StoredObject, request: dict[str, Any], reply: Reply, delivered: Delivered
    ) -> None:
        group = _groups.local_group(str(request.get("group")))
        if group is None or group.generation != request.get("generation"):
            raise GroupError(f"the producer is no longer in group {request.get('group')!r}")
        group.check_usable()
        dst, tag = int(request["dst"]), int(request["tag"])
        timeout = _bounded(request.get("timeout"))
        reply.send({"ok": True})
        lock = group.pair_lock(dst) if self.serialize_pairs else contextlib.nullcontext()
        try:
            with lock:
                for buf in obj.buffers:
                    if buf.numel():
                        group.process_group.send([buf], dst, tag).wait(timeout)
                self.synchronize()
        except Exception as exc:
            _groups.mark_broken(group, f"sending to rank {dst} failed: {exc}")
            raise
        delivered(obj.nbytes)

    # ---- consumer side
    def shared_group(self, extra: dict[str, Any]) -> tuple[_groups.Group, int] | None:
        """A live group of this backend that this process shares with the producer,
        and the producer's rank in it."""
        for name, (generation, rank) in sorted(extra.get("groups", {}).items()):
            group = _groups.local_group(name)
            if group is not None and group.generation == generation and group.backend == self.name:
                return group, int(rank)
        return None

    def reachable(self, extra: dict[str, Any]) -> bool:
        return self.shared_group(extra) is not None

    def receive(
        self, obj_id: bytes, extra: dict[str, Any], link: PeerMetadata, ranges: Ranges
    ) -> None:
        targets = ranges.dests  # whole tensors: this transport is not ``ranged``
        found = self.shared_group(extra)
        if found is None:
            raise TransportUnavailableError(
                f"this process shares no live {self.name} group with the producer"
            )
        group, src = found
        group.check_usable()
        tag = group.next_tag()
        lock = group.pair_lock(src) if self.serialize_pairs else contextlib.nullcontext()
        with lock, channel(link.producer.agent_address) as ch:
            # Refused: nothing is posted yet, so the group stays intact.
            self.ask_producer(
                ch,
                obj_id,
                link,
                group=group.name,
                generation=group.generation,
                dst=group.rank,
                tag=tag,
                timeout=link.remaining(),  # the producer's send waits no longer
            )
            try:
                self._receive_posted(group, src, tag, targets, link)
            except Exception as exc:
                _groups.mark_broken(group, f"receiving from rank {src} ({link.who}) failed: {exc}")
                raise GroupError(
                    f"a {self.name} transfer from {link.who} in group {group.name!r} failed "
                    f"({exc}); the group is unusable now: destroy it with "
                    f"rd.destroy_collective_group({group.name!r}) and create it again"
                ) from exc

    def _receive_posted(
        self, group: _groups.Group, src: int, tag: int, targets: Sequence[Any], link: PeerMetadata
    ) -> None:
        works = [group.process_group.recv([t], src, tag) for t in targets if t.numel()]
        timeout = _bounded(link.remaining())
        for work in works:
            work.wait(timeout)
        self.synchronize()


def _bounded(seconds: Any) -> datetime.timedelta:
    """How long one side of a transfer waits for the other: the consumer's
    deadline where it has one, else the groups' default, never past it."""
    bound = _groups.DEFAULT_TIMEOUT_S
    if isinstance(seconds, (int, float)) and not isinstance(seconds, bool):
        bound = min(max(float(seconds), 0.001), bound)
    return datetime.timedelta(seconds=bound)
