"""The control channel: one agent thread per process, and the client side.

The agent is a ZeroMQ ROUTER bound to this node's Ray address on a daemon
thread. It serves a producer's objects while the actor's own thread is busy
(sync, threaded and async actors alike); Ray actor calls cannot, because a
sync actor runs them only after its current task.

Requests are JSON (never pickle: the channel is reachable from the network);
each names an object and carries its 128-bit capability from the Payload, so
only holders of the ref can read the tensors. Where Ray's token authentication
is on, every request also carries a proof derived from the cluster's token, so
a process outside the cluster is refused before any object is looked up. Transports answer through a
``Reply``, from a small worker pool, so a slow staging copy never stalls the
channel; replies reach the ROUTER socket through an inproc queue because ZeroMQ
sockets belong to one thread.

Consumers talk through a per-thread cache of DEALER sockets. A socket monitor
and ZeroMQ heartbeats (answered by the peer's I/O thread, GIL or not) turn a
dead or unreachable producer into ``ProducerLostError`` within seconds.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import functools
import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from contextlib import contextmanager
from typing import Any

import zmq
from ray import cloudpickle
from zmq.utils.monitor import recv_monitor_message

from raydirect import _ray
from raydirect._store import StoredObject, store
from raydirect.errors import ProducerLostError, TransferError

log = logging.getLogger("raydirect")

_HEARTBEAT_IVL_MS = 2000
# Generous: a loaded 2-core machine can starve an I/O thread for seconds, and a
# dead process on this node is noticed at once anyway (refused connection, pid).
_HEARTBEAT_TIMEOUT_MS = 15000
_CONNECT_TIMEOUT_MS = 5000
_HANDSHAKE_IVL_MS = 5000
_RECONNECT_IVL_MS = 100
_RECONNECT_IVL_MAX_MS = 5000  # back off from an address nobody serves any more
_CACHED_CHANNELS = 16  # per thread
# Connections refused (or answered by something that is not an agent) this many
# times in a row mean nobody serves that address any more.
_REFUSALS_BEFORE_LOST = 5
_POLL_SLICE_MS = 200
# A consumer with no deadline waits this long for background preparation.
_MAX_PREPARE_WAIT = 3600.0
_DEATH_GRACE_S = 0.5
# Stream messages a consumer buffers ahead of its reader (16 MiB each for tcp).
_READ_AHEAD_MESSAGES = 4
# Requests are small JSON; a peer sending more is not a raydirect process and
# is disconnected by ZeroMQ before the agent buffers it.
_MAX_REQUEST_BYTES = 1 << 20
# Fire-and-forget messages: a reply to one would sit unread in the sender's
# cached channel and be taken as the answer to its next request.
_NOTIFY_OPS = ("sent", "abort")
_GROUP_OPS = ("group_broken", "group_leave")


def _process_start_time(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (0 if unknown or dead): with
    the pid it names one process even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    # The command name (field 2) may contain spaces, so count after ')'.
    fields = stat.rsplit(b")", 1)[1].split()
    if fields[0] in (b"Z", b"X"):  # killed but not yet reaped: its memory is gone
        return 0
    return int(fields[19])  # field 22


def process_alive(pid: int, start_time: int) -> bool:
    """Is the process ``pid`` that started at ``start_time`` still running (same node)?"""
    return _process_start_time(pid) == start_time != 0


PROCESS_TOKEN = secrets.token_bytes(16)
PID = os.getpid()
START_TIME = _process_start_time(PID)


@functools.lru_cache(maxsize=4)
def _auth_proof_for(session: tuple[int, str]) -> str | None:
    token = _ray.cluster_auth_token()
    if token is None:
        return None
    # A digest, not the token: whoever reads our traffic cannot replay it against Ray itself.
    return hmac.new(token, b"raydirect agent v1", hashlib.sha256).hexdigest()


def auth_proof() -> str | None:
    """What every request carries when Ray's token authentication is on (else None)."""
    return _auth_proof_for(_ray.session_key())


def _wants_reply(request: Any) -> bool:
    op = request.get("op") if isinstance(request, dict) else None
    if op in _NOTIFY_OPS:
        return False
    if op in _GROUP_OPS:
        return bool(request.get("reply"))
    return True


def _peer_of(frame: zmq.Frame) -> str:
    try:
        return str(frame.get("Peer-Address"))
    except zmq.ZMQError:
        return "?"


def _allow_memory_reads() -> None:
    """Let same-user processes read our memory with process_vm_readv (the cma
    transport) where Yama restricts ptrace. EINVAL where Yama is absent: nothing to do."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_ptracer, pr_set_ptracer_any = 0x59616D61, ctypes.c_ulong(-1)
        libc.prctl(pr_set_ptracer, pr_set_ptracer_any, 0, 0, 0)
    except OSError:
        pass


# ------------------------------------------------------------------ server


class Reply:
    """How a transport answers one request from inside the agent."""

    def __init__(self, outbox_address: str, identity: bytes, local: threading.local) -> None:
        self._address = outbox_address
        self._identity = identity
        self._local = local

    def _socket(self) -> zmq.Socket:
        sock = getattr(self._local, "push", None)
        if sock is None:
            sock = zmq.Context.instance().socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(self._address)
            self._local.push = sock
        return sock

    def send(self, header: dict[str, Any], *frames: Any, copy: bool = True) -> None:
        """One message: a JSON header and optional raw frames (sent zero-copy with
        ``copy=False``; ZeroMQ then holds a reference to each buffer until sent)."""
        parts = [self._identity, json.dumps(header).encode(), *frames]
        self._socket().send_multipart(parts, copy=copy)

    def send_frame(self, frame: Any) -> None:
        """One message of raw bytes, zero-copy: a chunk of a stream."""
        self._socket().send_multipart([self._identity, frame], copy=False)


class Agent:
    def __init__(self) -> None:
        ctx: zmq.Context = zmq.Context.instance()
        self._router = ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.SNDHWM, 0)
        self._router.setsockopt(zmq.RCVHWM, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A consumer that reconnects keeps its routing id: replies follow it.
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)
        ip = _ray.node_ip()
        port = self._router.bind_to_random_port(f"tcp://{ip}")
        self.address = f"tcp://{ip}:{port}"
        self._outbox_address = f"inproc://raydirect-outbox-{id(self)}"
        self._outbox = ctx.socket(zmq.PULL)
        self._outbox.setsockopt(zmq.RCVHWM, 0)
        self._outbox.bind(self._outbox_address)
        self._workers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="raydirect-serve")
        self._worker_local = threading.local()
        self._thread = threading.Thread(target=self._loop, name="raydirect-agent", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._outbox, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._outbox in events:
                # Drain replies first: they free consumers that are waiting.
                while True:
                    try:
                        parts = self._outbox.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    try:
                        self._router.send_multipart(parts, copy=False)
                    except zmq.ZMQError as exc:  # consumer gone (ROUTER_MANDATORY)
                        log.debug("raydirect agent: reply dropped: %s", exc)
            if self._router in events:
                while True:
                    try:
                        parts = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    if len(parts) < 2:  # a single-frame message: malformed
                        continue
                    self._workers.submit(self._handle, parts[0].bytes, parts[1])

    def _handle(self, identity: bytes, frame: zmq.Frame) -> None:
        reply = Reply(self._outbox_address, identity, self._worker_local)
        request: Any = None
        try:
            request = json.loads(frame.bytes)
            if not self._authenticated(request):
                log.warning(
                    "raydirect agent: request from %s without the Ray cluster's token refused",
                    _peer_of(frame),
                )
                if _wants_reply(request):
                    reply.send(
                        {
                            "ok": False,
                            "kind": "unauthenticated",
                            "error": "request refused: it does not carry this Ray cluster's "
                            "auth token (RAY_AUTH_MODE=token)",
                        }
                    )
                return
            op = request["op"]
            if op == "stats":  # counts only, no tensor data: needs no capability
                reply.send({"ok": True, "stats": dataclasses.asdict(store.stats())})
                return
            if op in _GROUP_OPS:  # authenticated by the group token
                from raydirect._groups import handle_control

                answer = handle_control(request)
                if request.get("reply"):
                    reply.send(answer)
                return
            obj_id = bytes.fromhex(request["obj"])
            capability = bytes.fromhex(request["cap"])
        # Anything a hostile peer can make json or the field checks raise (a
        # RecursionError from deeply nested JSON, say) is a refusal, never silence.
        except Exception as exc:
            log.warning(
                "raydirect agent: malformed request from %s refused (%s)",
                _peer_of(frame),
                type(exc).__name__,
            )
            if request is None or _wants_reply(request):
                reply.send(
                    {
                        "ok": False,
                        "kind": "bad_request",
                        "error": f"malformed request: {type(exc).__name__}",
                    }
                )
            return
        obj = store.get(obj_id)
        if obj is None or not hmac.compare_digest(obj.capability, capability):
            # Never log a capability, nor more of an object id than tells objects apart.
            log.log(
                logging.DEBUG if op in _NOTIFY_OPS else logging.WARNING,
                "raydirect agent: %r for %s from %s refused: %s",
                str(op)[:32],
                obj_id.hex()[:8],
                _peer_of(frame),
                "wrong capability" if obj is not None else "no such object (freed, or never here)",
            )
            if op not in _NOTIFY_OPS:
                reply.send(
                    {
                        "ok": False,
                        "kind": "lost",
                        "error": "object not held here: it was freed, or its producer restarted",
                    }
                )
            return
        if op == "abort":  # a plug-in transfer failed in the consumer: let the producer side abort
            from raydirect.transports.base import CommunicatorMetadata
            from raydirect.transports.registry import transport_instance

            try:
                transport = transport_instance(str(request.get("transport", "")))
                if transport.can_abort_transport():
                    transport.abort_transport(obj_id.hex(), CommunicatorMetadata())
            except Exception:
                log.exception("raydirect agent: abort of %s failed", obj_id.hex()[:8])
            return
        if op == "sent":  # a one-sided read finished: count it, check for in-place writes
            obj.check_unmodified()
            store.count_sent(request.get("transport", "?"), obj.nbytes)
            return
        if op == "meta":
            self._send_prepared(obj, request, reply)
            return
        if op != "fetch":
            reply.send({"ok": False, "kind": "bad_request", "error": f"unknown op {op!r}"})
            return
        from raydirect.transports.base import ByteTransport
        from raydirect.transports.registry import transport_instance

        name = request.get("transport", "")
        try:
            transport = transport_instance(name)
            if not isinstance(transport, ByteTransport):
                raise TransferError(f"transport {name!r} is not served by the agent")
            obj.check_unmodified()
            transport.serve(obj, request, reply)
            store.count_sent(name, obj.nbytes)
        except Exception as exc:
            log.exception("raydirect agent: serving %s over %s failed", obj_id.hex()[:8], name)
            reply.send({"ok": False, "kind": "transfer", "error": f"{type(exc).__name__}: {exc}"})

    @staticmethod
    def _authenticated(request: Any) -> bool:
        expected = auth_proof()
        if expected is None:
            return True
        got = request.get("auth") if isinstance(request, dict) else None
        return isinstance(got, str) and hmac.compare_digest(got.encode(), expected.encode())

    @staticmethod
    def _send_prepared(obj: StoredObject, request: dict[str, Any], reply: Reply) -> None:
        """Metadata prepared in the background, once ready (the consumer waits for it)."""
        name = str(request.get("transport", ""))
        future = obj.preparing.get(name)
        if future is None and request.get("prepare"):
            from raydirect._producer import prepare_on_request

            try:
                future = prepare_on_request(obj, name)
            except Exception as exc:
                reply.send({"ok": False, "kind": "transfer", "error": f"{name}: {exc}"})
                return
        if future is None:
            error = f"nothing prepared for {name}"
            reply.send({"ok": False, "kind": "bad_request", "error": error})
            return
        timeout = request.get("timeout")
        wait = _MAX_PREPARE_WAIT if timeout is None else min(float(timeout), _MAX_PREPARE_WAIT)
        try:
            meta = future.result(timeout=max(wait, 0.0))
        except FutureTimeoutError:
            reply.send({"ok": False, "kind": "transfer", "error": f"{name} still preparing"})
            return
        except Exception as exc:
            reply.send(
                {
                    "ok": False,
                    "kind": "transfer",
                    "error": f"preparing it for {name} failed: {type(exc).__name__}: {exc}",
                }
            )
            return
        reply.send({"ok": True}, cloudpickle.dumps(meta))


_agent: Agent | None = None
_agent_lock = threading.Lock()


def agent(label: str | None = None) -> Agent:
    """This process's agent, started on first use. ``label`` names the process in
    ``raydirect status`` (default: the task running now)."""
    global _agent
    if _agent is None:
        with _agent_lock:
            if _agent is None:
                _allow_memory_reads()
                from raydirect.transports.registry import on_agent_start

                on_agent_start()
                _agent = Agent()
                _announce(_agent, label)
                if _ray.tls_enabled():
                    log.warning(
                        "raydirect: Ray TLS is on (RAY_USE_TLS), but raydirect's control channel "
                        "and tcp transport are not encrypted: requests are authenticated, yet "
                        "tensor bytes cross the network in clear. Keep nodes on a trusted "
                        "network, or use a transport your network encrypts."
                    )
    return _agent


def _announce(server: Agent, label: str | None) -> None:
    """Publish this agent for ``raydirect status``; withdrawn at a clean exit."""
    key = f"{_ray.node_id()}/{PID}"
    info = {
        "address": server.address,
        "pid": PID,
        "node_id": _ray.node_id(),
        "actor_id": _ray.current_actor_id(),
        "label": label or _ray.current_task_label(),
    }
    try:
        _ray.publish_agent(key, json.dumps(info).encode())
        atexit.register(_ray.withdraw_agent, key)
    except Exception:  # status is a convenience: never fail a transfer for it
        log.debug("raydirect: could not publish the agent", exc_info=True)


# ------------------------------------------------------------------ client


_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class Channel:
    """One consumer's conversation with one producer's agent.

    "Connected" means the ZeroMQ handshake succeeded: a TCP connection alone
    can reach whatever reuses a dead agent's port (a Gloo listener, say).
    """

    # Set by the caller when the producer is on this node: checked while waiting.
    producer_alive: Callable[[], bool] | None = None

    def __init__(self, address: str) -> None:
        self.address = address
        self.socket: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
        # A fixed routing id: after a reconnect the agent's replies still reach us.
        self.socket.setsockopt(zmq.ROUTING_ID, secrets.token_bytes(16))
        for opt, value in (
            (zmq.RCVHWM, _READ_AHEAD_MESSAGES),
            (zmq.SNDHWM, 0),
            (zmq.LINGER, 0),
            (zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS),
            (zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS),
            (zmq.CONNECT_TIMEOUT, _CONNECT_TIMEOUT_MS),
            (zmq.HANDSHAKE_IVL, _HANDSHAKE_IVL_MS),
            (zmq.RECONNECT_IVL, _RECONNECT_IVL_MS),
            (zmq.RECONNECT_IVL_MAX, _RECONNECT_IVL_MAX_MS),
        ):
            self.socket.setsockopt(opt, value)
        self.monitor: zmq.Socket = self.socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_CONNECT_RETRIED
            | _HANDSHAKE_FAILED
        )
        self.socket.connect(address)
        self.connected = False
        self.refusals = 0
        self.lost = False
        self.poller = zmq.Poller()
        self.poller.register(self.socket, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(0)
        self.socket.close(0)

    def _read_monitor(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected, self.refusals = True, 0
            elif event == zmq.EVENT_DISCONNECTED:
                if self.connected:
                    self.lost = True
                self.connected = False
            elif event == zmq.EVENT_CONNECT_RETRIED or event & _HANDSHAKE_FAILED:
                self.refusals += 1

    def healthy(self) -> bool:
        self._read_monitor()
        return not self.lost

    def send(self, header: dict[str, Any]) -> None:
        proof = auth_proof()
        if proof is not None:
            header = {**header, "auth": proof}
        self.socket.send(json.dumps(header).encode())

    def wait_readable(self, deadline: float | None, who: str) -> None:
        """Block until a message is ready; ProducerLostError when the producer is
        gone, TimeoutError at ``deadline``."""
        while True:
            timeout = _POLL_SLICE_MS
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no answer from {who} before the deadline")
                timeout = min(timeout, max(1, int(remaining * 1000)))
            events = dict(self.poller.poll(timeout))
            if self.socket in events:
                return
            self._read_monitor()
            if self.producer_alive is not None and not self.producer_alive():
                raise ProducerLostError.of(who, "is no longer running")
            if self.lost:
                if self.producer_alive is not None and self._outlives_grace(self.producer_alive):
                    # Same node and still running: only the connection broke (reset,
                    # closed socket), the object is intact and a new read can succeed.
                    raise TransferError(
                        f"the connection to the agent of {who} broke during the transfer; "
                        "the producer is alive and still holds the object: read it again"
                    )
                raise ProducerLostError.of(
                    who, "is unreachable: its process died or its node is down"
                )
            if not self.connected and self.refusals >= _REFUSALS_BEFORE_LOST:
                raise ProducerLostError.of(
                    who, f"cannot be reached at {self.address}: its process died or restarted"
                )

    @staticmethod
    def _outlives_grace(alive: Callable[[], bool]) -> bool:
        """A killed process closes its sockets a moment before /proc shows it dead:
        only a producer still running after a short grace counts as alive."""
        until = time.monotonic() + _DEATH_GRACE_S
        while time.monotonic() < until:
            if not alive():
                return False
            time.sleep(0.02)
        return alive()

    def recv_reply(
        self, deadline: float | None, who: str
    ) -> tuple[dict[str, Any], list[zmq.Frame]]:
        self.wait_readable(deadline, who)
        parts = self.socket.recv_multipart(copy=False)
        try:
            header = json.loads(parts[0].bytes)
        except (ValueError, RecursionError) as exc:
            raise TransferError(f"corrupt reply from {who}: {exc}") from exc
        if not isinstance(header, dict):
            raise TransferError(f"corrupt reply from {who}: a {type(header).__name__} header")
        if not header.get("ok"):
            message = header.get("error", "unknown error")
            if header.get("kind") == "lost":
                raise ProducerLostError.of(who, f"no longer holds the object ({message})")
            if header.get("kind") == "unauthenticated":
                raise TransferError(
                    f"the producer {who} refused this process ({message}): run it in the same "
                    "Ray cluster, with the cluster's token (RAY_AUTH_TOKEN or ~/.ray/auth_token)"
                )
            raise TransferError(f"the producer {who} could not send the object: {message}")
        return header, parts[1:]

    def recv_into(self, view: memoryview, deadline: float | None, who: str) -> None:
        self.wait_readable(deadline, who)
        got = self.socket.recv_into(view)
        if got != len(view):
            raise TransferError(
                f"corrupt stream from {who}: a chunk of {got} bytes where {len(view)} were due"
            )


class _ChannelCache(threading.local):
    def __init__(self) -> None:
        # Most recently used last; bounded so that channels to producers long
        # gone do not pile up (each keeps sockets and reconnect attempts).
        self.channels: OrderedDict[str, Channel] = OrderedDict()


_channels = _ChannelCache()


@contextmanager
def channel(address: str) -> Iterator[Channel]:
    """A channel to ``address`` reused by this thread; closed (not reused) when the
    conversation fails midway, so no stray reply can reach the next one."""
    ch = _channels.channels.pop(address, None)
    if ch is not None and not ch.healthy():
        ch.close()
        ch = None
    if ch is None:
        ch = Channel(address)
    try:
        yield ch
    except BaseException:
        ch.close()
        raise
    else:
        cache = _channels.channels
        old = cache.pop(address, None)
        if old is not None:
            old.close()
        cache[address] = ch
        while len(cache) > _CACHED_CHANNELS:
            cache.popitem(last=False)[1].close()


def notify(address: str, header: dict[str, Any]) -> None:
    """Fire-and-forget message to an agent (no reply expected)."""
    with channel(address) as ch:
        ch.send(header)


def request(address: str, header: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Send ``header`` to an agent and return its one-message reply."""
    with channel(address) as ch:
        ch.send({**header, "reply": True})
        answer, _ = ch.recv_reply(time.monotonic() + timeout, address)
    return answer


def prepared_metadata(
    address: str, header: dict[str, Any], deadline: float | None, who: str
) -> Any:
    """Transport metadata the producer prepares in the background; waits for it."""
    remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
    with channel(address) as ch:
        ch.send({**header, "op": "meta", "reply": True, "timeout": remaining})
        _, frames = ch.recv_reply(deadline, who)
    if len(frames) != 1:
        raise TransferError(f"corrupt reply from {who}: {len(frames)} metadata frames")
    # The producer is the party whose Payload this process already unpickled.
    return cloudpickle.loads(frames[0].bytes)


def query_stats(address: str, timeout: float = 2.0) -> dict[str, Any]:
    """The ``LocalStats`` of the process whose agent listens at ``address``, as a dict."""
    return dict(request(address, {"op": "stats"}, timeout)["stats"])
