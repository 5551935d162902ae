"""The transport interface: a transport only moves bytes.

Method names and argument order follow Ray RDT's ``TensorTransportManager``
so a transport written for Ray ports by changing its imports. A transport
declares its sidedness and devices once, as class attributes.

Two kinds of transport share the interface:

* **plug-in** transports (``TensorTransportManager``, Ray RDT's contract):
  ``extract_tensor_transport_metadata`` receives the value's own tensors (or
  numpy arrays, per the registered ``data_type``); ``recv_multiple_tensors``
  returns the received tensors, allocating them unless ``target_buffers`` is
  given; ``garbage_collect`` receives the value's tensors. Object ids are hex
  strings. Registered with ``rd.register_tensor_transport``.
* **byte** transports (``ByteTransport``, the built-ins): they move the flat
  bytes of each tensor into receive buffers the orchestration allocated (one
  buffer per object, reused across objects), and may be served by the
  producer's agent (``serve``). Object ids are bytes.

Orchestration (choosing a transport, deadlines, fallbacks, counting, error
mapping) lives above, in ``raydirect._consumer``; transports never time out on
their own: they honour ``comm_meta.deadline`` and raise. A transport imports
this module, ``_channel``, ``_process``, ``_tensors``, ``_region_seals`` and
``errors``, nothing else of raydirect (the collective ones also their group state).

Call diagram for a one-sided transport::

    producer process                          consumer process
    rd.method returns
      extract_tensor_transport_metadata   ->  (metadata rides in the Payload, or,
        (on the preparation thread when        when prepared in the background, the
         extract_in_background)                consumer asks the agent and waits)
                                              recv_multiple_tensors(obj_id, meta,
                                                  comm_meta, target_buffers)
      serve(obj, request, reply)   <-agent-      (pull-style transports ask the agent)
    last ref gone
      garbage_collect(obj_id, meta, tensors)
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from raydirect import _notices, _process, _wire
from raydirect._channel import Channel
from raydirect._ranges import Ranges
from raydirect._region_seals import Seal, seal_value
from raydirect.errors import (
    ProducerLostError,
    TransferError,
    TransportUnavailableError,
)

if TYPE_CHECKING:
    from raydirect._payload import ProducerInfo
    from raydirect._server import Reply
    from raydirect._store import StoredObject

Delivered = Callable[[int], None]
"""What a ``ByteTransport.serve`` calls with the bytes a consumer got, once it has them."""


@dataclass
class TensorTransportMetadata:
    """What a transport extracted from an object in the producer; it travels to
    the consumer inside the ref's value. Subclass it to carry transport-specific
    fields (they must pickle).

    ``tensor_meta``: one ``(shape, dtype)`` per tensor; ``tensor_device``: the
    device type of the tensors (all alike).
    """

    tensor_meta: list[Any]
    tensor_device: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class CommunicatorMetadata:
    """Who talks to whom for one transfer; subclass it to carry what your
    transport needs (made by ``get_communicator_metadata`` in the consumer)."""


class WriteGate:
    """One call's hold on the memory its reads write (``rd.get`` of several refs,
    a sharded weight load): every read writes only while it holds the gate
    (``writing``), and notices between pieces when the gate has closed
    (``PeerMetadata.check_deadline``). ``close`` shuts the gate and waits until
    no read is writing, so once the call has returned or raised, none of its
    reads writes the caller's tensors (or a receive buffer) any more."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._writers = 0
        self.closed = False

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Hold the gate while writing; ``TimeoutError`` if it has closed."""
        with self._cond:
            if self.closed:
                raise TimeoutError(CALLED_OFF)
            self._writers += 1
        try:
            yield
        finally:
            with self._cond:
                self._writers -= 1
                self._cond.notify_all()

    def close(self) -> None:
        """No read starts writing from now on; returns once none is writing. A
        writer stops at its next piece (at most a few ms; a ``tcp`` stream after
        its next receive), or, where its transport cannot stop midway (a posted
        collective receive), at its end or its deadline."""
        with self._cond:
            self.closed = True
            self._cond.wait_for(lambda: self._writers == 0)


CALLED_OFF = "the read was called off: another read of the same call failed or timed out"


@dataclass
class PeerMetadata(CommunicatorMetadata):
    """What byte transports get: the producer's address and the object's
    capability, and the deadline the orchestration set for this transfer."""

    producer: ProducerInfo
    capability: bytes
    deadline: float | None = None  # time.monotonic() by which the transfer must finish
    same_node: bool = False  # the producer runs on this node: its pid can be checked
    gate: WriteGate | None = None  # the call's gate: closed, the transfer stops
    nbytes: int = 0  # the object's bytes, which its capability vouches for (read notices)

    @property
    def who(self) -> str:
        return self.producer.describe()

    def producer_alive(self) -> bool:
        """False once a producer on this node has died (a pid reused by another
        process counts as dead); True for producers on other nodes."""
        producer = self.producer
        return not self.same_node or _process.process_alive(producer.pid, producer.start_time)

    def check_alive(self, what: str = "is no longer running") -> None:
        """``ProducerLostError`` if a producer on this node has died."""
        if not self.producer_alive():
            raise ProducerLostError.of(self.who, what)

    def remaining(self) -> float | None:
        if self.gate is not None and self.gate.closed:
            return 0.0
        return None if self.deadline is None else self.deadline - time.monotonic()

    def check_deadline(self) -> None:
        """Raise TimeoutError once the deadline has passed or the call's gate has
        closed (call between chunks)."""
        if self.gate is not None and self.gate.closed:
            raise TimeoutError(CALLED_OFF)
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise TimeoutError("transfer deadline passed")


class ReadSeal:
    """The seal of the object a same-node read copies from (``_region_seals``),
    checked before the copy and after its last byte landed: ``check`` raises
    ``ProducerLostError`` unless the object is still served (not freed, nor, for
    a region, closed)."""

    def __init__(self, obj_id: bytes, extra: dict[str, Any], link: PeerMetadata) -> None:
        # A region's extent (made by its reader, RegionHandle.payload): the seal
        # holds only while the addresses and sizes read by are the exported ones.
        # An object's metadata has none: sealed before it is extracted, its
        # addresses travel inside the Payload Ray carries to its refs' holders
        # (cluster members); a region's handle is the only sealed metadata that
        # travels outside Ray.
        extent = extra.get("extent", b"")
        if not isinstance(extent, bytes):
            raise TransferError(f"corrupt transport metadata from {link.who}: extent={extent!r}")
        producer, want = link.producer, seal_value(obj_id, link.capability, extent)
        try:
            self._seal = Seal(extra["seal"], producer.pid, producer.start_time, want)
        except ValueError as exc:
            raise TransferError(f"corrupt transport metadata from {link.who}: {exc}") from exc
        self._link, self._extra = link, extra
        if not self._seal.visible:
            link.check_alive()  # an exited producer's slabs are gone with it
            raise TransportUnavailableError(
                f"this process cannot see the seals of {link.who} ({self._seal.path}), which "
                "a same-node read checks (is the object still held?): the two processes do "
                f"not share {os.path.dirname(self._seal.path)}. Run them with one /dev/shm "
                "(one container, or --ipc=host), or read with tensor_transport='tcp'"
            )

    @classmethod
    def of(cls, obj_id: bytes, extra: dict[str, Any], link: PeerMetadata) -> ReadSeal | None:
        """The object's seal, None for metadata that names none (a plug-in's)."""
        return None if extra.get("seal") is None else cls(obj_id, extra, link)

    def check(self) -> None:
        if not self._seal.holds():
            self._link.check_alive()  # an exited producer's seals are gone with it
            raise ProducerLostError.by_seal(self._link.who, self._extra)


def metadata_classes() -> dict[str, type]:
    """The metadata classes a message may name (``_wire``'s codec): the subclasses
    of ``TensorTransportMetadata`` and ``CommunicatorMetadata`` loaded in this
    process (a plug-in's arrive with its registration), and nothing else."""
    found: dict[str, type] = {}
    todo: list[type] = [TensorTransportMetadata, CommunicatorMetadata]
    while todo:
        cls = todo.pop()
        found[_wire.class_key(cls)] = cls
        todo.extend(cls.__subclasses__())
    return found


@dataclass
class FetchRequest:
    """A fetch started by ``fetch_multiple_tensors``; the default (synchronous)
    implementation stores the received tensors here. Transports with true async
    fetches subclass it to carry their handles, and release resources in
    ``__del__`` so that an abandoned request leaks nothing."""

    obj_id: Any
    tensors: list[Any]


class TensorTransportManager(ABC):
    """Interface of every transport (Ray RDT's method names and argument order).

    Class attributes, declared once: ``one_sided`` (the consumer reads without
    the producer calling ``send_multiple_tensors``), ``devices`` (device types
    whose memory it moves; ``receive_devices``: what else it can write into),
    ``same_node_only`` (reaches only processes of the
    producer's node). The name is the one given at registration.

    Lifecycle of one object, and where each method runs::

        producer (method returns)   extract_tensor_transport_metadata(obj_id, tensors)
        consumer (ref rebuilt)      actor_has_tensor_transport(actor)
                                    get_communicator_metadata(src_actor, dst_actor, name)
                                    fetch_multiple_tensors(...) / wait_fetch_complete(...)
                                      (default: recv_multiple_tensors(...))
        producer (two-sided only)   send_multiple_tensors(tensors, meta, comm_meta)
        producer (last ref gone)    garbage_collect(obj_id, meta, tensors)
        both (a transfer failed)    abort_transport(obj_id, comm_meta), if can_abort_transport()

    Timeouts come from raydirect's orchestration, not from the transport: a
    fetch that outlives ``rd.get``'s deadline is abandoned (its result dropped).
    """

    name: ClassVar[str] = ""
    one_sided: ClassVar[bool] = True
    devices: ClassVar[tuple[str, ...]] = ("cpu",)
    receive_devices: ClassVar[tuple[str, ...]] = ()
    """Device types a byte transport's ``receive`` can write into besides
    ``devices`` (``rd.get(ref, device=...)``, a weight subscriber's targets on
    another device); empty: only ``devices``. Elsewhere the orchestration reads
    into memory of ``devices`` and copies over."""
    same_node_only: ClassVar[bool] = False
    byte_transport: ClassVar[bool] = False
    extract_in_background: ClassVar[bool] = True
    """Run ``extract_tensor_transport_metadata`` on raydirect's preparation
    thread once the producer method has returned, so slow preparation (copies,
    memory registration) never delays the method or the actor's next call; a
    consumer that arrives first waits for it. Set it to False when extraction
    must run on the method's own thread."""

    def tensor_transport_backend(self) -> str:
        """The transport's name."""
        return self.name

    @classmethod
    def is_one_sided(cls) -> bool:
        """True if only the consumer acts in a transfer (no ``send_multiple_tensors``)."""
        return cls.one_sided

    @classmethod
    def can_abort_transport(cls) -> bool:
        """True if ``abort_transport`` can interrupt a transfer in flight on both
        sides without leaving either blocked. When False, a failed transfer is
        reported and the consumer's partial result dropped."""
        return False

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        """Can ``actor`` (this process's actor handle, None in a driver or task)
        use this transport? Called in the consumer before each transfer; False
        makes raydirect fall back to ``tcp``. Must not raise."""
        return True

    def reachable(self, extra: dict[str, Any]) -> bool:
        """Byte transports: can this process read an object whose extracted
        ``extra`` metadata is this (two-sided: is it in one of the producer's
        groups)? False makes the orchestration fall back to another transport."""
        return True

    def extract_tensor_transport_metadata(
        self, obj_id: Any, tensors: list[Any]
    ) -> TensorTransportMetadata:
        """Called in the producer when an object is made, on the thread that ran
        the method, before it returns: keep it cheap. ``tensors`` stay alive and
        unchanged (unless the user writes them) until ``garbage_collect``. Raising
        fails the producer's method call and leaves nothing stored."""
        return TensorTransportMetadata(tensor_meta=[(tuple(t.shape), t.dtype) for t in tensors])

    def get_communicator_metadata(
        self, src_actor: Any, dst_actor: Any, backend: str | None = None
    ) -> CommunicatorMetadata:
        """Called in the consumer before a transfer. ``dst_actor`` is the
        consumer's own actor handle, None in a driver or task. ``src_actor`` is
        None for one-sided transports (raydirect reaches producers through their
        agents); for two-sided ones it is the producer's actor handle, None when
        the producer is a driver or a task. Two-sided: the result travels to the
        producer's agent as JSON (``_wire``'s codec: a dataclass of plain values,
        bytes, tuples, dicts, dtypes), never as pickle."""
        return CommunicatorMetadata()

    def send_multiple_tensors(
        self, tensors: list[Any], meta: TensorTransportMetadata, comm_meta: CommunicatorMetadata
    ) -> None:
        """Two-sided transports: called in the producer, on a thread of its agent,
        while the consumer's ``recv_multiple_tensors`` runs with the same
        ``comm_meta``; once per read. Raising fails that read with a
        ``TransferError`` naming the transport (after ``abort_transport`` on both
        sides when ``can_abort_transport()``); the object stays readable."""
        raise NotImplementedError(f"{type(self).__name__} is one-sided: nothing to send")

    @abstractmethod
    def recv_multiple_tensors(
        self,
        obj_id: Any,
        meta: TensorTransportMetadata,
        comm_meta: CommunicatorMetadata,
        target_buffers: list[Any] | None = None,
    ) -> list[Any]:
        """Called in the consumer, on a fetch thread. Returns the object's tensors
        in order, equal in shape and dtype to what ``meta`` describes, written into
        ``target_buffers`` when given. On failure raises; a partial result is
        dropped. Raise ``ProducerLostError`` when the producer is gone."""

    def fetch_multiple_tensors(
        self,
        obj_id: Any,
        meta: TensorTransportMetadata,
        comm_meta: CommunicatorMetadata,
        target_buffers: list[Any] | None = None,
    ) -> FetchRequest:
        """Start a fetch; the default receives synchronously."""
        return FetchRequest(
            obj_id, self.recv_multiple_tensors(obj_id, meta, comm_meta, target_buffers)
        )

    def wait_fetch_complete(self, fetch_request: FetchRequest, timeout: float = -1) -> list[Any]:
        """Wait for a fetch (``timeout`` seconds, -1 for ever; ``TimeoutError`` past it)."""
        return fetch_request.tensors

    def garbage_collect(self, obj_id: Any, meta: Any, tensors: Sequence[Any]) -> None:
        """Called in the producer once no ref to the object is left anywhere (on a
        reaper thread). Release what ``extract``/``serve`` set up. Exceptions are
        logged and ignored. Received copies are the consumer's, never collected here."""

    def abort_transport(self, obj_id: Any, comm_meta: CommunicatorMetadata) -> None:
        """Interrupt a transfer in flight; called on both sides after a failure
        when ``can_abort_transport()``. Must not block."""


class ByteTransport(TensorTransportManager):
    """Base of the built-in transports: they move each tensor's flat bytes.

    The orchestration hands ``extract``/``garbage_collect`` the flat uint8 view
    of each tensor, and ``recv_multiple_tensors`` one preallocated flat uint8
    buffer per tensor (views of one receive buffer per object) together with a
    ``PeerMetadata``. Subclasses implement ``receive``: fill the buffers or
    raise. Those whose reads the producer's agent does not see (``notify_sent``)
    get one "sent" notice sent for them after each read, so the producer counts
    it and checks the tensors were not written in place.
    """

    byte_transport = True
    extract_in_background = False  # the built-ins' extraction is cheap, except nixl's
    notify_sent: ClassVar[bool] = False
    ranged: ClassVar[bool] = False
    """True if ``receive`` reads any ``Ranges``; False if it reads only whole
    objects (the orchestration then reads whole tensors and copies the slices)."""
    sealed: ClassVar[bool] = False
    """True if ``receive`` copies from the producer's memory without its agent,
    checking the object's seal after it (``ReadSeal``, or a read of its own): the
    producer hands it each object's seal in ``with_seal``."""

    def with_seal(self, extra: dict[str, Any], slot: int) -> dict[str, Any]:
        """``extra`` (what ``extract_tensor_transport_metadata`` made, producer side)
        with the object's seal (``Store.seal``), for sealed transports' readers."""
        return {**extra, "seal": slot}

    def extract_tensor_transport_metadata(
        self, obj_id: Any, tensors: list[Any]
    ) -> TensorTransportMetadata:
        return TensorTransportMetadata(tensor_meta=[])

    def serve(
        self, obj: StoredObject, request: dict[str, Any], reply: Reply, delivered: Delivered
    ) -> None:
        """Called in the producer's agent (a worker thread) when a consumer asks
        for ``obj`` over this transport. Answers through ``reply``, and calls
        ``delivered`` with the bytes the consumer gets (all of the object's, or the
        ranges it asked for) once it has them: before returning when the reply
        carries them or they wait in memory the consumer maps, later and from
        another thread when they stream (``tcp``), never for a read that ended
        short (it counts as a read: ``reads=N`` frees the object after the N-th).
        Raising sends the consumer a ``TransferError`` with the exception's text.
        May run concurrently for different objects and for the same object."""
        raise NotImplementedError(f"transport {self.name!r} serves no agent requests")

    def recv_multiple_tensors(
        self,
        obj_id: Any,
        meta: TensorTransportMetadata,
        comm_meta: CommunicatorMetadata,
        target_buffers: list[Any] | None = None,
    ) -> list[Any]:
        if not isinstance(comm_meta, PeerMetadata) or target_buffers is None:
            raise TypeError("byte transports are called by raydirect's orchestration only")
        self.read(obj_id, meta.extra, comm_meta, Ranges.of_whole(target_buffers))
        return target_buffers

    def read(
        self, obj_id: bytes, extra: dict[str, Any], link: PeerMetadata, ranges: Ranges
    ) -> None:
        """What the orchestration calls: ``receive``, then the "sent" notice for
        transports whose reads the producer's agent does not see (queued: a
        thread of its own sends it, ``_notices``)."""
        self.receive(obj_id, extra, link, ranges)
        if self.notify_sent:
            producer = link.producer
            same_node = link.same_node
            _notices.notices.post(
                producer.agent_address,
                producer.pid if same_node else 0,
                producer.start_time if same_node else 0,
                [obj_id.hex(), link.capability.hex(), self.name, ranges.nbytes, link.nbytes],
            )

    @abstractmethod
    def receive(
        self, obj_id: bytes, extra: dict[str, Any], link: PeerMetadata, ranges: Ranges
    ) -> None:
        """Fill ``ranges.dests`` with the bytes ``ranges`` names (whole tensors
        unless the class is ``ranged``), or raise: ``ProducerLostError`` when the
        producer is gone, ``TimeoutError`` past ``link.deadline``,
        ``TransportUnavailableError`` when this transport cannot reach it,
        ``TransferError`` otherwise. After a raise the destinations may hold
        some, all or none of the bytes, never bytes that failed authentication
        (an encrypted stream's)."""

    def ask_producer(
        self, ch: Channel, obj_id: bytes, comm_meta: PeerMetadata, **extra: Any
    ) -> tuple[dict[str, Any], list[Any]]:
        """Ask the producer's agent to ``serve`` the object over this transport;
        returns its first reply (header and any inline frames). Waits in slices,
        so a closed gate ends the wait (``TimeoutError``) within one."""
        if comm_meta.same_node:  # let the channel notice the producer's death by pid at once
            ch.producer_alive = comm_meta.producer_alive
        ch.send(
            {
                "op": _wire.FETCH,
                "obj": obj_id.hex(),
                "cap": comm_meta.capability.hex(),
                "transport": self.name,
                **extra,
            }
        )
        if comm_meta.gate is None:
            return ch.recv_reply(comm_meta.deadline, comm_meta.who)
        while True:
            comm_meta.check_deadline()
            until = time.monotonic() + _GATE_SLICE_S
            with contextlib.suppress(TimeoutError):
                return ch.recv_reply(comm_meta.deadline, comm_meta.who, until=until)


_GATE_SLICE_S = 0.1  # how often a wait for the producer's answer looks at the gate
