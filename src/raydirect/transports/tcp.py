"""``tcp``: the producer's agent sends tensor bytes over TCP; works across nodes.

The request goes over the agent's control channel (ZeroMQ CURVE, authenticated,
capability checked). Objects up to ``INLINE_MAX_BYTES`` come back inline in the
reply. Everything larger is answered with a ticket, and its bytes move over the
producer's stream port (``_stream_server``), the one bulk path: from the
producer's tensor memory into the consumer's receive buffer with the kernel's
copy only, over one or more streams (``RAYDIRECT_TCP_STREAMS``), in TLS where
the producer encrypts (its address says so: ``_wire.AgentAddress``).

There used to be a third path, 16 MiB ZeroMQ frames on the control socket, for
objects under 4 MiB and for encrypted agents (CURVE). Measured (docs/cluster.md),
the stream port is as fast at 1 MiB and several times faster encrypted, so the
control socket now carries control only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from raydirect import _stream_client, _stream_server
from raydirect._channel import Channel, channel
from raydirect._ranges import Ranges, copy_runs
from raydirect.errors import TransferError
from raydirect.transports.base import ByteTransport, Delivered, PeerMetadata

if TYPE_CHECKING:
    from raydirect._server import Reply
    from raydirect._store import StoredObject

INLINE_MAX_BYTES = 64 << 10


def byte_view(t: torch.Tensor) -> memoryview:
    """Writable memoryview over a flat uint8 CPU tensor's bytes."""
    return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]


def requested(obj: StoredObject, request: dict[str, Any]) -> Ranges | None:
    """The ranges a request asks for (None: the whole object), checked against ``obj``."""
    rows = request.get("ranges")
    if rows is None:
        return None
    try:
        return Ranges.requested(rows, obj.buffers.lengths.tolist())
    except ValueError as exc:
        raise ValueError(f"bad ranges in the request: {exc}") from exc


def _sources(obj: StoredObject, ranges: Ranges | None) -> list[torch.Tensor]:
    """The bytes to send, one flat tensor per row (strided rows gathered once).
    A region's (``obj.live``) are copied out now, while the read holds the
    region open: its owner may reuse the memory once it closes the region, and
    the stream sends after this returns."""
    if obj.live is not None:
        ranges = ranges or Ranges.of_whole(obj.buffers)
        copied = _snapshot(obj, ranges)
        if copied.numel() > INLINE_MAX_BYTES:
            return [copied]  # streamed: the consumer lands it across its rows' buffers
        return list(copied.split((ranges.length * ranges.count).tolist()))  # a frame per row
    if ranges is None:
        return list(obj.buffers)
    out = []
    for row in range(len(ranges.index)):
        source = obj.buffers[int(ranges.index[row])]
        view = ranges.strided_view(source, row)
        out.append(
            view.reshape(-1) if int(ranges.count[row]) == 1 else view.contiguous().reshape(-1)
        )
    return out


def _snapshot(obj: StoredObject, ranges: Ranges) -> torch.Tensor:
    """The rows' bytes, back to back, in memory of their own."""
    out = torch.empty(ranges.nbytes, dtype=torch.uint8)
    packed = ranges.packed(out.data_ptr())
    copy_runs(*packed.runs(obj.buffers.addresses), lambda: None)
    return out


class TcpTransport(ByteTransport):
    name = "tcp"
    one_sided = True
    devices = ("cpu",)
    ranged = True

    def serve(
        self, obj: StoredObject, request: dict[str, Any], reply: Reply, delivered: Delivered
    ) -> None:
        sources = _sources(obj, requested(obj, request))
        nbytes = sum(s.numel() for s in sources)
        if nbytes <= INLINE_MAX_BYTES:
            reply.send({"ok": True, "inline": True}, *[s.numpy().tobytes() for s in sources])
            delivered(nbytes)
            return
        streams = _stream_server.running()
        if streams is None:
            raise RuntimeError("this agent has no stream port")
        # Counted on the last byte: a stream that fails (the consumer's deadline,
        # a reset) used up no read of a reads=N object, which it can then read again.
        views = [byte_view(s) for s in sources]
        ticket, secret, _ = streams.issue(views, lambda: delivered(nbytes))
        offer = {"port": streams.port, "ticket": ticket.hex(), "secret": secret.hex()}
        reply.send({"ok": True, "stream": offer})

    def receive(
        self, obj_id: bytes, extra: dict[str, Any], link: PeerMetadata, ranges: Ranges
    ) -> None:
        who = link.who
        asked: dict[str, Any] = {} if ranges.whole else {"ranges": ranges.rows()}
        _stream_client.configured_streams()  # a bad RAYDIRECT_TCP_STREAMS: refused before asking
        with channel(link.producer.agent_address) as ch:
            header, frames = self.ask_producer(ch, obj_id, link, **asked)
            if header.get("inline"):
                _copy_inline(frames, ranges.dests, who)
                return
            offer = header.get("stream")
            if not isinstance(offer, dict):
                raise TransferError(f"corrupt reply from {who}: neither inline nor a stream")
            _receive_streams(ch, offer, link, ranges.dests)


def _receive_streams(
    ch: Channel, offer: dict[str, Any], link: PeerMetadata, dests: Sequence[torch.Tensor]
) -> None:
    who = link.who
    try:
        peer = _stream_client.Peer((ch.host, int(offer["port"])), ch.tls_pin, who)
        ticket, secret = bytes.fromhex(offer["ticket"]), bytes.fromhex(offer["secret"])
    except (KeyError, TypeError, ValueError) as exc:
        raise TransferError(f"corrupt reply from {who}: a bad stream offer") from exc

    def watch() -> None:  # on this thread, when a socket idles: the producer
        ch.check_peer(who, link.deadline)

    try:  # every stream stops within one receive once the call's gate closes
        _stream_client.receive(
            peer,
            ticket,
            secret,
            [byte_view(d) for d in dests],
            link.deadline,
            watch,
            link.check_deadline,
        )
    except TimeoutError:
        raise
    except (OSError, EOFError) as exc:  # ProducerLostError if that is what happened
        what = f"the tcp stream from {who} broke"
        raise ch.why_broken(who, link.deadline, what, str(exc)) from exc


def _copy_inline(frames: list[Any], targets: Sequence[torch.Tensor], who: str) -> None:
    if len(frames) != len(targets):
        raise TransferError(
            f"corrupt reply from {who}: {len(frames)} tensors where {len(targets)} were due"
        )
    for frame, target in zip(frames, targets, strict=True):
        data = frame.buffer
        if len(data) != target.numel():
            raise TransferError(
                f"corrupt reply from {who}: a tensor of {len(data)} bytes "
                f"where {target.numel()} were due"
            )
        byte_view(target)[:] = data
