"""The producer's side of the control channel: a ROUTER that dispatches ops.

The server is a ZeroMQ ROUTER bound to this node's Ray address on a daemon
thread. It serves while the actor's own thread is busy (sync, threaded and
async actors alike); Ray actor calls cannot, because a sync actor runs them
only after its current task.

It knows no op's meaning. Each layer registers the ops it owns (``register``),
as dask/distributed's ``Server(handlers=...)`` is filled by its extensions:
the producer registers fetch/meta/sent/abort, the group API the group ops, the
agent runtime ``stats``. Who may connect at all is settled by the CURVE
handshake (``_gate``: the cluster's key where Ray's token authentication is on);
for object ops the server checks that the object is held here and the request
carries its capability before the handler runs.

Handlers run on worker threads, in one of three lanes: ``DATA`` for ops that
may take long (streaming an object, a collective send), ``CONTROL`` for short
ones (notices, group ops, stats), and ``PLUGIN`` for two-sided plug-in sends,
which a plug-in that cannot abort may hold for as long as its send hangs; so
slow consumers and stuck plug-ins never hold up the rest. Replies reach the
ROUTER socket through an inproc queue because a ZeroMQ socket belongs to one
thread. What reaches a lane at all is decided first, on the loop thread,
without decoding (``_admission``). The agent's sockets live in a ZeroMQ context
of their own, so its ZAP handler answers for its ROUTER only.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from raydirect import _wire
from raydirect._admission import Admission, RateLimitedLog
from raydirect._gate import HANDSHAKE_S, ConnectionCap, ZapHandler
from raydirect._store import StoredObject, store
from raydirect.errors import ProducerLostError

log = logging.getLogger("raydirect")
_log = RateLimitedLog()  # what peers can trigger at will is logged at a bounded rate

DATA = "data"
CONTROL = "control"
PLUGIN = "plugin"  # two-sided plug-in sends: a plug-in that cannot abort may hang in one
_LANE_THREADS = {DATA: 4, CONTROL: 2, PLUGIN: 2}
# Requests are small JSON; a peer sending more is not a raydirect process and
# is disconnected by ZeroMQ before the agent buffers it.
MAX_REQUEST_BYTES = 1 << 20
_RCVHWM = 1000
_BATCH = 256  # messages handled per turn of the loop, each way


def open_reply_socket(ctx: zmq.Context, outbox_address: str, local: threading.local) -> zmq.Socket:
    """The calling worker thread's socket to the agent's outbox (ZeroMQ sockets
    belong to one thread). Opened when the thread starts, so that the agent's
    fds are fixed from then on, whichever threads serve what."""
    sock: zmq.Socket = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(outbox_address)
    local.push = sock
    return sock


class Reply:
    """How a handler answers one request (from its worker thread)."""

    def __init__(
        self, ctx: zmq.Context, outbox_address: str, identity: bytes, local: threading.local
    ) -> None:
        self._ctx = ctx
        self._address = outbox_address
        self._identity = identity
        self._local = local

    def _socket(self) -> zmq.Socket:
        sock = getattr(self._local, "push", None)
        return open_reply_socket(self._ctx, self._address, self._local) if sock is None else sock

    def send(self, header: dict[str, Any], *frames: Any, copy: bool = True) -> None:
        """One message: a JSON header and optional raw frames (sent zero-copy with
        ``copy=False``; ZeroMQ then holds a reference to each buffer until sent)."""
        parts = [self._identity, _wire.encode_header(header), *frames]
        self._socket().send_multipart(parts, copy=copy)


class _Lane:
    """Worker threads started up front (a fixed set: the agent's thread count does
    not depend on what peers send), fed by a queue that admission bounds."""

    def __init__(self, name: str, threads: int, on_start: Callable[[], None]) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]]] = (
            queue.SimpleQueue()
        )
        self._on_start = on_start
        for i in range(threads):
            threading.Thread(target=self._work, name=f"raydirect-{name}-{i}", daemon=True).start()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        self._queue.put((fn, args))

    def _work(self) -> None:
        self._on_start()
        while True:
            fn, args = self._queue.get()
            try:
                fn(*args)
            except Exception:  # a handler's own errors are answered inside it
                log.exception("raydirect agent: a worker's task failed; still serving")


@dataclass(frozen=True)
class Handler:
    fn: Callable[..., None]
    needs_object: bool
    lane: str


_handlers: dict[str, Handler] = {}


def register(op: str, fn: Callable[..., None], *, needs_object: bool, lane: str) -> None:
    """Serve ``op`` with ``fn``: ``fn(obj, request, reply)`` when ``needs_object``
    (the server found the object and checked the capability), else
    ``fn(request, reply)``. A handler that raises sends the consumer a refusal."""
    if lane not in _LANE_THREADS:
        raise ValueError(f"unknown lane {lane!r}")
    _handlers[op] = Handler(fn, needs_object, lane)


def _peer_of(frame: zmq.Frame) -> str:
    try:
        return str(frame.get("Peer-Address"))
    except zmq.ZMQError:
        return "?"


class Server:
    """The agent's ROUTER. ``tls``: the pin its stream port's TLS goes by (``_tls``),
    carried in its address; None when the stream port is in clear."""

    def __init__(self, ip: str, *, tls: str | None = None) -> None:
        ctx = self._ctx = zmq.Context()  # its own: the ZAP handler answers for it only
        self.admission = Admission(tuple(_LANE_THREADS))
        self._zap = ZapHandler(ctx, self.admission)
        self._router = ctx.socket(zmq.ROUTER)
        public, secret = zmq.curve_keypair()  # fresh per process
        for opt, value in (
            (zmq.SNDHWM, 0),
            # Per connection: a peer that sends faster than the agent reads is held
            # back by TCP, instead of queueing in the agent's memory.
            (zmq.RCVHWM, _RCVHWM),
            (zmq.ROUTER_MANDATORY, 1),
            (zmq.LINGER, 0),
            (zmq.MAXMSGSIZE, MAX_REQUEST_BYTES),
            # A connection that has not finished its CURVE handshake by then is closed.
            (zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000)),
            (zmq.CURVE_SERVER, 1),
            (zmq.CURVE_SECRETKEY, secret),
            (zmq.ZAP_DOMAIN, b"raydirect"),
        ):
            self._router.setsockopt(opt, value)
        self.connections = ConnectionCap(self._router)
        port = self._router.bind_to_random_port(f"tcp://{ip}")
        self.address = _wire.agent_address(f"tcp://{ip}:{port}", public, tls)
        self._outbox_address = f"inproc://raydirect-outbox-{id(self)}"
        self._outbox = ctx.socket(zmq.PULL)
        self._outbox.setsockopt(zmq.RCVHWM, 0)
        self._outbox.bind(self._outbox_address)
        self._worker_local = threading.local()
        self._lanes = {
            lane: _Lane(lane, n, self._open_worker_socket) for lane, n in _LANE_THREADS.items()
        }
        self._thread = threading.Thread(target=self._loop, name="raydirect-agent", daemon=True)
        self._thread.start()

    def _open_worker_socket(self) -> None:
        open_reply_socket(self._ctx, self._outbox_address, self._worker_local)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._outbox, zmq.POLLIN)
        poller.register(self.connections.events, zmq.POLLIN)
        while True:
            # Nothing a peer sends, nor a bug below, may end the agent: log, keep serving.
            try:
                events = dict(poller.poll())
                if self._outbox in events:  # replies first: they free waiting consumers
                    self._forward_replies()
                if self._router in events:
                    self._dispatch_requests()
                if self.connections.events in events:
                    self.connections.handle()
            except Exception:
                log.exception("raydirect agent: unexpected error; still serving")

    def _forward_replies(self) -> None:
        for _ in range(_BATCH):
            try:
                parts = self._outbox.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._router.send_multipart(parts, copy=False)
            except zmq.ZMQError as exc:  # consumer gone (ROUTER_MANDATORY)
                log.debug("raydirect agent: reply dropped: %s", exc)

    def _dispatch_requests(self) -> None:
        # A bounded batch, then back to the poll: replies must go out under a flood.
        for _ in range(_BATCH):
            try:
                parts = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(parts) != 2:  # requests are one frame after the identity
                self.admission.note("malformed")
                continue
            identity, frame = parts[0].bytes, parts[1]
            data = frame.bytes
            op = _peek_op(data)
            handler = _handlers.get(op)
            lane = handler.lane if handler is not None else CONTROL
            busy = self.admission.admit(identity, lane)
            if busy is not None:
                _log.warning("busy", "raydirect agent: a request refused: %s", busy)
                if _wire.wants_reply_raw(op, data):
                    self._send(identity, _wire.refusal(_wire.BUSY, busy))
                continue
            self._lanes[lane].submit(self._run_admitted, identity, lane, frame)

    def _run_admitted(self, identity: bytes, lane: str, frame: zmq.Frame) -> None:
        try:
            self._handle(identity, frame)
        finally:
            self.admission.done(identity, lane)

    def _send(self, identity: bytes, header: dict[str, Any]) -> None:
        """A reply from the loop thread itself (which owns the ROUTER socket)."""
        with contextlib.suppress(zmq.ZMQError):  # the peer is gone
            self._router.send_multipart([identity, _wire.encode_header(header)])

    def _handle(self, identity: bytes, frame: zmq.Frame) -> None:
        reply = Reply(self._ctx, self._outbox_address, identity, self._worker_local)
        request: Any = None
        try:
            request = json.loads(frame.bytes)
            handler = _handlers.get(request["op"])
            if handler is None:
                reply.send(_wire.refusal(_wire.BAD_REQUEST, f"unknown op {request['op']!r}"))
                return
            obj = self._object_for(request, frame, reply) if handler.needs_object else None
        # Anything a hostile peer can make json or the field checks raise (a
        # RecursionError from deeply nested JSON, say) is a refusal, never silence.
        except Exception as exc:
            _log.warning(
                "malformed",
                "raydirect agent: malformed request from %s refused (%s)",
                _peer_of(frame),
                type(exc).__name__,
            )
            if request is None or _wire.wants_reply(request):
                reply.send(
                    _wire.refusal(_wire.BAD_REQUEST, f"malformed request: {type(exc).__name__}")
                )
            return
        if handler.needs_object and obj is None:
            return  # refused by _object_for
        self._run(handler, obj, request, reply)

    @staticmethod
    def _run(handler: Handler, obj: StoredObject | None, request: dict, reply: Reply) -> None:
        try:
            if handler.needs_object:
                handler.fn(obj, request, reply)
            else:
                handler.fn(request, reply)
        except ProducerLostError as exc:  # freed after _object_for found it
            if _wire.wants_reply(request):
                reply.send(_wire.refusal(_wire.LOST, str(exc)))
        except Exception as exc:
            log.exception("raydirect agent: %r failed", str(request.get("op"))[:32])
            if _wire.wants_reply(request):
                reply.send(_wire.refusal(_wire.TRANSFER, f"{type(exc).__name__}: {exc}"))

    @staticmethod
    def _object_for(request: dict[str, Any], frame: zmq.Frame, reply: Reply) -> StoredObject | None:
        """The object a request names, if held here and the capability matches."""
        obj_id = bytes.fromhex(request["obj"])
        capability = bytes.fromhex(request["cap"])
        obj = store.get(obj_id)
        if obj is not None and hmac.compare_digest(obj.capability, capability):
            return obj
        op = request.get("op")
        # Never log a capability, nor more of an object id than tells objects apart.
        why = "wrong capability" if obj is not None else "no such object (freed, or never here)"
        message = "raydirect agent: %r for %s from %s refused: %s"
        args = (str(op)[:32], obj_id.hex()[:8], _peer_of(frame), why)
        if op in _wire.NOTIFY_OPS:  # a late notice for a freed object: expected
            log.debug(message, *args)
        else:
            _log.warning(f"capability: {why}", message, *args)
        if _wire.wants_reply(request):
            freed = store.why_freed(obj_id) if obj is None else None
            why = f"freed {freed}" if freed else "it was freed, or its producer restarted"
            reply.send(_wire.refusal(_wire.LOST, f"object not held here: {why}"))
        return None


def _peek_op(data: bytes) -> str:
    """The op of a request, cheaply, only to pick its lane (the handler re-checks
    everything); unknown or malformed goes to the control lane."""
    start = data.find(b'"op": "')
    if start < 0:
        return ""
    start += 7
    end = data.find(b'"', start, start + 32)
    return data[start:end].decode("ascii", "replace") if end > 0 else ""
