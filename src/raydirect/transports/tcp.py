"""``tcp``: the producer's agent sends tensor bytes over TCP; works across nodes.

The request goes over the agent's control channel (ZeroMQ, authenticated,
capability checked). Objects of ``STREAM_MIN_BYTES`` or more are answered with
a ticket, and their bytes move over plain TCP connections (``_stream_server``):
from the producer's tensor memory into the consumer's receive buffer with the
kernel's copy only, over one or more streams (``RAYDIRECT_TCP_STREAMS``).

Smaller objects stay on the control channel, where a connection already exists:
up to ``INLINE_MAX_BYTES`` inline in the reply, else 16 MiB ZeroMQ frames sent
zero-copy and received into slices of the receive buffer (libzmq copies each
frame once more; with ``RAYDIRECT_TCP_STREAMS=0`` every object goes this way).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from raydirect import _stream_client, _stream_server
from raydirect._channel import Channel, channel
from raydirect._ranges import Ranges
from raydirect.errors import TransferError
from raydirect.transports.base import ByteTransport, PeerMetadata

if TYPE_CHECKING:
    from raydirect._server import Reply
    from raydirect._store import StoredObject

CHUNK_BYTES = 16 << 20
INLINE_MAX_BYTES = 64 << 10
# Below this a ticket's extra round trip (and perhaps a connection) costs more
# than the control channel's extra copy.
STREAM_MIN_BYTES = 4 << 20
# After a stream breaks, how long the control channel gets to report the
# producer's death (a ProducerLostError says more than a broken stream).
_LOSS_GRACE_S = 2.0


def chunks(view: memoryview, size: int = CHUNK_BYTES):
    for start in range(0, len(view), size):
        yield view[start : start + size]


def byte_view(t: torch.Tensor) -> memoryview:
    """Writable memoryview over a flat uint8 CPU tensor's bytes."""
    return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]


def requested(obj: StoredObject, request: dict[str, Any]) -> Ranges | None:
    """The ranges a request asks for (None: the whole object), checked against ``obj``."""
    rows = request.get("ranges")
    if rows is None:
        return None
    try:
        ranges = Ranges.of_rows([[int(v) for v in row] for row in rows], [])
        ranges.check_within(obj.buffers.lengths.tolist())
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad ranges in the request: {exc}") from exc
    return ranges


def _sources(obj: StoredObject, ranges: Ranges | None) -> list[torch.Tensor]:
    """The bytes to send, one flat tensor per row (strided rows gathered once)."""
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


class TcpTransport(ByteTransport):
    name = "tcp"
    one_sided = True
    devices = ("cpu",)
    ranged = True

    def serve(self, obj: StoredObject, request: dict[str, Any], reply: Reply) -> int:
        sources = _sources(obj, requested(obj, request))
        nbytes = sum(s.numel() for s in sources)
        if nbytes <= INLINE_MAX_BYTES:
            reply.send({"ok": True, "inline": True}, *[s.numpy().tobytes() for s in sources])
            return nbytes
        streams = _stream_server.running()
        if request.get("streams") and nbytes >= STREAM_MIN_BYTES and streams is not None:
            ticket, _ = streams.issue([byte_view(s) for s in sources])
            reply.send({"ok": True, "stream": {"port": streams.port, "ticket": ticket.hex()}})
            return nbytes
        reply.send({"ok": True, "inline": False, "chunk": CHUNK_BYTES})
        for source in sources:
            for piece in chunks(byte_view(source)):
                reply.send_frame(piece)
        return nbytes

    def receive(
        self, obj_id: bytes, extra: dict[str, Any], link: PeerMetadata, ranges: Ranges
    ) -> None:
        who = link.who
        asked: dict[str, Any] = {} if ranges.whole else {"ranges": ranges.rows()}
        if _stream_client.enabled():
            asked["streams"] = True
        with channel(link.producer.agent_address) as ch:
            header, frames = self.ask_producer(ch, obj_id, link, **asked)
            if header.get("inline"):
                _copy_inline(frames, ranges.dests, who)
                return
            if isinstance(header.get("stream"), dict):
                _receive_streams(ch, header["stream"], link, ranges.dests)
                return
            chunk = header.get("chunk")
            if not isinstance(chunk, int) or chunk <= 0:
                raise TransferError(f"corrupt reply from {who}: chunk size {chunk!r}")
            for dest in ranges.dests:
                for piece in chunks(byte_view(dest), chunk):
                    link.check_deadline()  # a closed gate too
                    ch.recv_into(piece, link.deadline, who)


def _receive_streams(
    ch: Channel, offer: dict[str, Any], link: PeerMetadata, dests: Sequence[torch.Tensor]
) -> None:
    who = link.who
    try:
        address = (ch.address.rpartition("//")[2].rpartition(":")[0], int(offer["port"]))
        ticket = bytes.fromhex(offer["ticket"])
    except (KeyError, TypeError, ValueError) as exc:
        raise TransferError(f"corrupt reply from {who}: bad stream offer {offer!r}") from exc

    def watch() -> None:  # on this thread, between pieces: the producer, and the gate
        ch.check_peer(who)
        link.check_deadline()

    try:
        _stream_client.receive(address, ticket, [byte_view(d) for d in dests], link.deadline, watch)
    except TimeoutError:
        raise
    except OSError as exc:
        until = time.monotonic() + _LOSS_GRACE_S
        while time.monotonic() < until:  # ProducerLostError if that is what happened
            ch.check_peer(who)
            time.sleep(0.05)
        raise TransferError(
            f"the tcp stream from {who} broke during the transfer ({exc}); the producer is "
            "alive and still holds the object: read it again"
        ) from exc


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
