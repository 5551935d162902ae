"""The transport interface: a transport only moves bytes.

Method names and argument order follow Ray RDT's ``TensorTransportManager``
so a transport written for Ray ports by changing its imports. A transport
declares its name, sidedness and devices once, as class attributes.

Orchestration (choosing a transport, deadlines, fallbacks, counting, error
mapping) lives above, in ``raydirect._fetch``; transports never time out on
their own: they honour ``comm_meta.deadline`` and raise.

Call diagram for a one-sided transport::

    producer process                          consumer process
    rd.method returns
      extract_tensor_transport_metadata   ->  (metadata rides in the Payload)
                                              recv_multiple_tensors(obj_id, meta,
                                                  comm_meta, target_buffers)
      serve(obj, request, reply)   <-agent-      (pull-style transports ask the agent)
    last ref gone
      garbage_collect(obj_id, meta, tensors)
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from raydirect._agent import Channel, Reply
    from raydirect._payload import ProducerInfo
    from raydirect._store import StoredObject
    from raydirect._tensors import TensorMeta


@dataclass
class TensorTransportMetadata:
    """What a transport extracted from an object in the producer; travels in the Payload."""

    tensor_meta: list[TensorMeta]
    tensor_device: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class CommunicatorMetadata:
    """Who talks to whom for one transfer, built by the orchestration in the consumer."""

    producer: ProducerInfo
    capability: bytes
    deadline: float | None = None  # time.monotonic() by which the transfer must finish

    def remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def check_deadline(self) -> None:
        """Raise TimeoutError once the deadline has passed (call between chunks)."""
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise TimeoutError("transfer deadline passed")


@dataclass
class FetchRequest:
    """A one-sided fetch started by ``fetch_multiple_tensors``."""

    obj_id: bytes
    meta: TensorTransportMetadata
    comm_meta: CommunicatorMetadata
    target_buffers: list[torch.Tensor]
    result: Any = None


class TensorTransportManager(ABC):
    """Base class of every transport.

    Class attributes (declared once):
      ``name``: the registered name; ``one_sided``: the consumer reads without
      the producer's help (beyond its agent); ``devices``: device types whose
      memory it moves; ``same_node_only``: reaches only processes of one node.
    """

    name: ClassVar[str]
    one_sided: ClassVar[bool] = True
    devices: ClassVar[tuple[str, ...]] = ("cpu",)
    same_node_only: ClassVar[bool] = False

    def tensor_transport_backend(self) -> str:
        return self.name

    @classmethod
    def is_one_sided(cls) -> bool:
        return cls.one_sided

    @classmethod
    def can_abort_transport(cls) -> bool:
        """True if ``abort_transport`` can interrupt a transfer in flight."""
        return False

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        """Can ``actor`` use this transport? Called by the orchestration before use."""
        return True

    def reachable(self, extra: dict[str, Any]) -> bool:
        """Consumer side: can this process read, over this transport, an object
        whose extracted metadata is ``extra``? (Two-sided transports: is this
        process in one of the producer's groups.) When False the orchestration
        falls back to another transport."""
        return True

    # ---- producer side -------------------------------------------------
    def extract_tensor_transport_metadata(
        self, obj_id: bytes, tensors: list[torch.Tensor]
    ) -> TensorTransportMetadata:
        """Called in the producer when an object is exported, on the thread that
        ran the method. Must be cheap: it delays the method's return. ``tensors``
        are flat uint8 CPU tensors that stay alive until ``garbage_collect``."""
        return TensorTransportMetadata(tensor_meta=[])

    def serve(self, obj: StoredObject, request: dict[str, Any], reply: Reply) -> None:
        """Called in the producer's agent (a worker thread) when a consumer asks
        for ``obj`` over this transport. Answers through ``reply``; raising sends the
        consumer a ``TransferError`` with the exception's text. May run concurrently
        for different objects and for the same object."""
        raise NotImplementedError(f"transport {self.name!r} serves no agent requests")

    def garbage_collect(
        self, obj_id: bytes, meta: TensorTransportMetadata | None, tensors: list[torch.Tensor]
    ) -> None:
        """Called in the producer once no ref to the object is left anywhere (reaper
        thread). Releases what ``serve``/``extract`` set up; must not raise."""

    # ---- consumer side -------------------------------------------------
    def ask_producer(
        self, ch: Channel, obj_id: bytes, comm_meta: CommunicatorMetadata, **extra: Any
    ) -> tuple[dict[str, Any], list[Any]]:
        """Ask the producer's agent to ``serve`` the object over this transport;
        returns its first reply (header and any inline frames)."""
        ch.send(
            {
                "op": "fetch",
                "obj": obj_id.hex(),
                "cap": comm_meta.capability.hex(),
                "transport": self.name,
                **extra,
            }
        )
        return ch.recv_reply(comm_meta.deadline, comm_meta.producer.describe())

    @abstractmethod
    def recv_multiple_tensors(
        self,
        obj_id: bytes,
        meta: TensorTransportMetadata,
        comm_meta: CommunicatorMetadata,
        target_buffers: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Called in the consumer on a fetch thread. Fills ``target_buffers`` (flat
        uint8 tensors, one per tensor, each exactly the tensor's byte size) and
        returns them. On failure raises; the buffers may then hold some, all or
        none of the data and are discarded by the caller. Raise
        ``ProducerLostError`` when the producer is gone, ``TimeoutError`` past
        ``comm_meta.deadline``."""

    def fetch_multiple_tensors(
        self,
        obj_id: bytes,
        meta: TensorTransportMetadata,
        comm_meta: CommunicatorMetadata,
        target_buffers: list[torch.Tensor],
    ) -> FetchRequest:
        """Start a fetch without waiting (default: do it now, synchronously)."""
        request = FetchRequest(obj_id, meta, comm_meta, target_buffers)
        request.result = self.recv_multiple_tensors(obj_id, meta, comm_meta, target_buffers)
        return request

    def wait_fetch_complete(self, request: FetchRequest) -> list[torch.Tensor]:
        """Wait for a fetch started by ``fetch_multiple_tensors``."""
        return request.result

    def abort_transport(self, obj_id: bytes, comm_meta: CommunicatorMetadata) -> None:
        """Interrupt a transfer in flight (only if ``can_abort_transport``)."""
