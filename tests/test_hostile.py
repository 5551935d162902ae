"""Hostile input on the wire: corrupt, truncated or oversized frames, on the control
channel (against a real agent) and on the tcp and shm transports (from a fake
agent, against the consumer). Each is refused with an error; the agent keeps
serving; nothing is written outside the receive buffer.

Complements tests/test_security.py (capabilities, a few malformed requests).
"""

from __future__ import annotations

import json
import os
import pickle
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import raydirect as rd
from raydirect import _consumer, _process, _stream_server, _wire
from raydirect._payload import PREPARING, Payload, ProducerInfo
from raydirect.transports.base import PeerMetadata, TensorTransportMetadata, metadata_classes
from raydirect.transports.registry import transport_instance

from actors import Producer, check_value
from helpers import agent_dealer

_CONTEXT = zmq.Context()  # the test's own: what is checked is the agent, not our channels
ANSWER_S = 30.0  # bound on any answer from the agent under test


# ------------------------------------------------------------ the control channel


@pytest.fixture(scope="module")
def producer(ray_session) -> Iterator[tuple[Any, str]]:
    p = Producer.remote()
    address = ray.get(
        p.__ray_call__.remote(
            lambda self: __import__("raydirect._runtime", fromlist=["agent"]).agent().address
        )
    )
    yield p, address
    ray.kill(p)


def _dealer(address: str) -> zmq.Socket:
    """A DEALER with the cluster's CURVE key: what reaches the agent's loop at all."""
    return agent_dealer(_CONTEXT, address)


def _with_auth(fields: dict[str, Any]) -> bytes:
    """A request as a raydirect process sends it (the CURVE key authenticates it)."""
    return json.dumps(fields).encode()


def _still_serves(p: Any) -> None:
    assert check_value("dtypes", rd.get(p.value.remote("dtypes"), timeout=ANSWER_S)) is None
    ref = p.value_tcp.remote("views")
    assert check_value("views", rd.get(ref, timeout=ANSWER_S, tensor_transport="tcp")) is None


def test_deeply_nested_json_is_refused_not_dropped(producer):
    """json raises RecursionError on deep nesting: once a silent drop (no reply)."""
    p, address = producer
    sock = _dealer(address)
    try:
        for raw in (b"[" * 100_000, b'{"op": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"):
            sock.send(raw)
            assert sock.poll(ANSWER_S * 1000), "no answer: the request was dropped silently"
            reply = json.loads(sock.recv())
            assert reply["ok"] is False and reply["kind"] == "bad_request"
    finally:
        sock.close()
    _still_serves(p)


def test_an_op_that_is_no_string_is_refused_not_dropped(producer):
    """An op JSON makes a list or a dict of: once a TypeError while deciding
    whether to answer, so the peer got silence and the agent logged a traceback."""
    p, address = producer
    sock = _dealer(address)
    try:
        for op in (["fetch"], {"op": "fetch"}, 7, None):
            sock.send(_with_auth({"op": op, "obj": "00", "cap": "00"}))
            assert sock.poll(ANSWER_S * 1000), f"no answer to op {op!r}: dropped silently"
            reply = json.loads(sock.recv())
            assert reply["ok"] is False and reply["kind"] == "bad_request", reply
    finally:
        sock.close()
    _still_serves(p)


def test_oversized_request_is_cut_off(producer):
    """Requests are small JSON: a peer sending megabytes is disconnected by ZeroMQ
    before the agent buffers it, and the agent goes on serving everyone else."""
    p, address = producer
    sock = _dealer(address)
    try:
        sock.send(b"x" * (4 << 20))
        assert not sock.poll(2000), "the agent answered a 4 MiB request"
    finally:
        sock.close()
    _still_serves(p)


_OPS = ["fetch", "stats", "sent", "abort", "group_broken", "group_leave"]
_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)
_hex = st.binary(min_size=0, max_size=20).map(bytes.hex)
_requests = st.fixed_dictionaries(
    {"op": st.sampled_from(_OPS) | st.text(max_size=8) | _json},
    optional={
        "obj": _hex | _json,
        "cap": _hex | _json,
        "transport": st.sampled_from(["tcp", "shm", "cma", "gloo", "nccl", "nope"]) | _json,
        "reply": st.booleans(),
        "group": st.text(max_size=8),
        "generation": st.integers(),
        "token": _hex,
        "extra": _json,
    },
)
_messages = st.one_of(
    st.lists(st.binary(max_size=64), min_size=1, max_size=3),  # raw frames
    _requests.map(lambda r: [_with_auth(r)]),  # well-formed JSON, wrong content
    _requests.map(lambda r: [_with_auth(r)[: len(_with_auth(r)) // 2]]),  # truncated
)


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batch=st.lists(_messages, min_size=1, max_size=8))
def test_fuzzed_control_messages_are_refused(producer, batch):
    p, address = producer
    sock = _dealer(address)
    try:
        for frames in batch:
            sock.send_multipart(frames)
        sock.send(_with_auth({"op": "stats", "marker": True}))
        # Replies arrive from a worker pool, in any order: read until the agent has
        # answered our stats request, and check every refusal on the way.
        deadline = time.monotonic() + ANSWER_S
        seen_ours = False
        while not seen_ours:
            assert sock.poll(max(1, int((deadline - time.monotonic()) * 1000))), "agent silent"
            reply = json.loads(sock.recv())
            if reply.get("ok"):
                harmless = ("stats", "known", "counted")  # a batch of read notices: 0 counted
                assert any(k in reply for k in harmless), reply  # harmless answers only
                seen_ours = seen_ours or "stats" in reply
            else:
                assert reply["kind"] in ("bad_request", "lost", "unauthenticated"), reply
    finally:
        sock.close()


def test_agent_survives_the_fuzzing(producer):
    p, _ = producer
    pid = ray.get(p.pid.remote())
    _still_serves(p)
    assert ray.get(p.pid.remote()) == pid  # the same process: nothing crashed and restarted


# ---------------------------------------------- the consumer against a fake agent

GUARD = 4096  # canary bytes around every receive buffer
CANARY = 0xA5


class FakeAgent:
    """A CURVE ROUTER answering the first request with scripted messages, then
    either staying silent or closing (a producer that truncates its stream)."""

    def __init__(self, messages: list[list[bytes]], close: bool = False) -> None:
        self.sock = _CONTEXT.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        public, secret = zmq.curve_keypair()
        self.sock.setsockopt(zmq.CURVE_SERVER, 1)
        self.sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        host = ray.util.get_node_ip_address()
        endpoint = f"tcp://{host}:{self.sock.bind_to_random_port(f'tcp://{host}')}"
        self.address = _wire.agent_address(endpoint, public, None)
        self._messages, self._close = messages, close
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        if self.sock.poll(30_000):
            identity = self.sock.recv_multipart()[0]
            for message in self._messages:
                self.sock.send_multipart([identity, *message])
            if not self._close:
                self._done.wait(60)
        self.sock.close()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(30)


def _header(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def _receive(address: str, transport: str, sizes: list[int], timeout: float) -> torch.Tensor:
    """Receive from the fake agent into buffers with canaries around each; returns
    the whole arena (buffers and canaries). Raises what the transport raises."""
    arena = torch.full((sum(sizes) + GUARD * (len(sizes) + 1),), CANARY, dtype=torch.uint8)
    targets, pos = [], GUARD
    for size in sizes:
        targets.append(arena[pos : pos + size])
        pos += size + GUARD
    producer = ProducerInfo(
        agent_address=address,
        node_id="another-node",  # no pid watch: the fake is not a Ray worker
        pid=os.getpid(),
        start_time=_process.START_TIME,
        process_token=secrets.token_bytes(16),
        label="Fake.agent",
    )
    link = PeerMetadata(producer, secrets.token_bytes(16), time.monotonic() + timeout)
    meta = TensorTransportMetadata([], "cpu", {})
    try:
        transport_instance(transport).recv_multiple_tensors(
            secrets.token_bytes(16), meta, link, targets
        )
    finally:
        _check_canaries(arena, sizes)
    return arena


def _check_canaries(arena: torch.Tensor, sizes: list[int]) -> None:
    pos = 0
    for size in [*sizes, 0]:
        guard = arena[pos : pos + GUARD]
        assert bool((guard == CANARY).all()), f"bytes written outside the receive buffer at {pos}"
        pos += GUARD + size


SIZES = [100_000, 1000]  # bytes of the two tensors the consumer expects


class FakeStreamPort:
    """A stream port that greets, challenges, accepts any request, says OK, sends
    ``partial`` bytes, then stays silent, or closes ``close_after`` seconds in."""

    def __init__(self, partial: bytes, close_after: float | None = None) -> None:
        self.listener = socket.create_server((ray.util.get_node_ip_address(), 0))
        self.port = self.listener.getsockname()[1]
        self._partial, self._close_after = partial, close_after
        self._done = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        start = time.monotonic()
        conn.sendall(_stream_server.READY + b"c" * _stream_server.CHALLENGE_BYTES)
        got = b""
        while len(got) < _stream_server.REQUEST.size:
            got += conn.recv(_stream_server.REQUEST.size - len(got))
        conn.sendall(bytes([_stream_server.OK]) + self._partial)
        if self._close_after is None:
            self._done.wait(60)
        else:
            self._done.wait(max(0.0, start + self._close_after - time.monotonic()))
        conn.close()

    def offer(self) -> bytes:
        return _header(
            ok=True, stream={"port": self.port, "ticket": "00" * 16, "secret": "11" * 16}
        )

    def stop(self) -> None:
        self._done.set()
        self.listener.close()


CORRUPT_TCP: dict[str, tuple[list[list[bytes]], type[Exception], str]] = {
    "not json": ([[b"\xff not json"]], rd.TransferError, "corrupt reply"),
    "json list header": ([[b"[1, 2]"]], rd.TransferError, "corrupt reply"),
    "deep json header": ([[b"[" * 100_000]], rd.TransferError, "corrupt reply"),
    "refusal without reason": ([[_header(ok=False)]], rd.TransferError, "unknown error"),
    "says lost": ([[_header(ok=False, kind="lost", error="x")]], rd.ProducerLostError, "lost"),
    "inline, too few tensors": (
        [[_header(ok=True, inline=True), b"\0" * SIZES[0]]],
        rd.TransferError,
        "1 tensors where 2",
    ),
    "inline, tensor too long": (
        [[_header(ok=True, inline=True), b"\1" * (SIZES[0] + 10), b"\1" * SIZES[1]]],
        rd.TransferError,
        "where 100000 were due",
    ),
    "inline, tensor too short": (
        [[_header(ok=True, inline=True), b"\1" * SIZES[0], b"\1" * 10]],
        rd.TransferError,
        "where 1000 were due",
    ),
    "neither inline nor a stream": ([[_header(ok=True)]], rd.TransferError, "neither"),
    "a stream offer without a ticket": (
        [[_header(ok=True, stream={"port": 1})]],
        rd.TransferError,
        "bad stream offer",
    ),
    "a stream offer with a bad port": (
        [[_header(ok=True, stream={"port": "x", "ticket": "00", "secret": "00"})]],
        rd.TransferError,
        "bad stream offer",
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(CORRUPT_TCP))
def test_corrupt_tcp_replies_are_rejected_inside_the_buffer(ray_session, case):
    messages, error, fragment = CORRUPT_TCP[case]
    fake = FakeAgent(messages)
    try:
        with pytest.raises(error, match=fragment):
            _receive(fake.address, "tcp", SIZES, timeout=20)
    finally:
        fake.stop()


@pytest.mark.timeout(120)
def test_truncated_tcp_stream_ends_at_the_deadline(ray_session):
    port = FakeStreamPort(b"\4" * 4096)  # then silence, connection open
    fake = FakeAgent([[port.offer()]])
    start = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            _receive(fake.address, "tcp", SIZES, timeout=3)
    finally:
        fake.stop()
        port.stop()
    assert time.monotonic() - start < 3 + 2


@pytest.mark.timeout(120)
def test_truncated_tcp_stream_then_closed_is_a_lost_producer(ray_session):
    port = FakeStreamPort(b"\4" * 4096, close_after=0.2)
    fake = FakeAgent([[port.offer()]], close=True)
    start = time.monotonic()
    try:
        with pytest.raises(rd.ProducerLostError, match="unreachable"):
            _receive(fake.address, "tcp", SIZES, timeout=60)
    finally:
        port.stop()
    assert time.monotonic() - start < 20


@pytest.mark.timeout(120)
@pytest.mark.parametrize("before_deadline_s", [0.3, 1.0])
def test_a_stream_broken_just_before_the_deadline_raises_by_the_deadline(
    ray_session, before_deadline_s
):
    """Issue 24 item 6: telling a dead producer from a broken connection waits up to
    2 s for evidence (``_channel.LOSS_GRACE_S``), but never past the caller's
    deadline. The producer's agent stays up; its stream breaks shortly before the
    deadline: the read ends by the deadline (plus scheduling), not 2 s later."""
    timeout = 3.0
    port = FakeStreamPort(b"\4" * 4096, close_after=timeout - before_deadline_s)
    fake = FakeAgent([[port.offer()]])
    start = time.monotonic()
    try:
        with pytest.raises((rd.TransferError, TimeoutError)) as info:
            _receive(fake.address, "tcp", SIZES, timeout=timeout)
    finally:
        fake.stop()
        port.stop()
    elapsed = time.monotonic() - start
    assert elapsed < timeout + 0.5, (elapsed, info.value)
    if isinstance(info.value, rd.TransferError):
        assert "broke" in str(info.value) and "read it again" in str(info.value)


def _shm_reply(**fields: Any) -> list[list[bytes]]:
    return [[_header(ok=True, **fields)]]


CORRUPT_SHM: dict[str, tuple[list[list[bytes]], str]] = {
    "path escape": (_shm_reply(segment="../../etc/passwd", size=4096, offsets=[0, 0]), "name"),
    "slash in name": (_shm_reply(segment="rd-x/../../etc/hosts", size=10, offsets=[0, 0]), "name"),
    "dot dot": (_shm_reply(segment="..", size=10, offsets=[0, 0]), "name"),
    "not our prefix": (_shm_reply(segment="psm_x", size=10, offsets=[0, 0]), "name"),
    "offset past the end": (
        _shm_reply(segment="rd-1-1-1", size=SIZES[0], offsets=[0, SIZES[0]]),
        "outside the segment",
    ),
    "negative offset": (
        _shm_reply(segment="rd-1-1-1", size=1 << 20, offsets=[-5, 0]),
        "outside the segment",
    ),
    "too few offsets": (_shm_reply(segment="rd-1-1-1", size=1 << 20, offsets=[0]), "outside"),
    "missing fields": (_shm_reply(segment="rd-1-1-1"), "corrupt reply"),
    "no such segment": (
        _shm_reply(segment="rd-0-0-nothing", size=1 << 20, offsets=[0, SIZES[0]]),
        "segment",
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(CORRUPT_SHM))
def test_corrupt_shm_replies_are_rejected(ray_session, case):
    messages, fragment = CORRUPT_SHM[case]
    fake = FakeAgent(messages)
    try:
        with pytest.raises(rd.TransferError, match=fragment):
            _receive(fake.address, "shm", SIZES, timeout=20)
    finally:
        fake.stop()


@pytest.mark.timeout(120)
def test_shm_segment_smaller_than_claimed_is_rejected(ray_session, tmp_path):
    """A real segment, but the reply claims more bytes than it has: mapping it
    would read past its end (SIGBUS); refused instead."""
    name = f"rd-0-0-test{secrets.token_hex(4)}"
    path = os.path.join("/dev/shm", name)
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    fake = FakeAgent(_shm_reply(segment=name, size=1 << 20, offsets=[0, SIZES[0]]))
    try:
        with pytest.raises(rd.TransferError, match="segment"):
            _receive(fake.address, "shm", SIZES, timeout=20)
    finally:
        fake.stop()
        os.unlink(path)


# ------------------------------------------- metadata replies never carry pickle


class _Trap:
    """Unpickling this creates a file: proof that a reply was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _meta_of(address: str, transport: str) -> Any:
    """What the consumer makes of a ``meta`` reply from the (fake) agent at ``address``."""
    producer = ProducerInfo(
        agent_address=address,
        node_id="another-node",
        pid=os.getpid(),
        start_time=_process.START_TIME,
        process_token=secrets.token_bytes(16),
        label="Fake.agent",
    )
    payload = Payload(
        obj_id=secrets.token_bytes(16),
        capability=secrets.token_bytes(16),
        skeleton=b"",
        handles=[],
        metas=[],
        transport=transport,
        producer=producer,
        transport_meta={transport: PREPARING},
    )
    return _consumer._transport_meta(payload, transport, time.monotonic() + 20)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "reply",
    [
        "pickle frame",  # what raydirect's agent sent before: cloudpickle in a frame
        "pickle as bytes",  # a pickle where the codec puts byte strings
        "unknown class",
    ],
)
def test_a_metadata_reply_is_never_unpickled(ray_session, tmp_path, reply):
    trap = str(tmp_path / "unpickled")
    evil = pickle.dumps(_Trap(trap))
    messages = {
        "pickle frame": [[_header(ok=True), evil]],
        "pickle as bytes": [[_header(ok=True, meta={"__bytes__": 0}), evil]],
        "unknown class": [
            [_header(ok=True, meta={"__dataclass__": "os:system", "fields": {"command": "x"}})]
        ],
    }[reply]
    fake = FakeAgent(messages)
    try:
        if reply == "pickle as bytes":
            assert _meta_of(fake.address, "pickle_shm") == evil  # just bytes, never loaded
        else:
            with pytest.raises(rd.TransferError, match="corrupt metadata"):
                _meta_of(fake.address, "pickle_shm")
    finally:
        fake.stop()
    assert not os.path.exists(trap)


def test_plugin_metadata_round_trips_without_pickle():
    from plugin_transports import PickleShmMetadata

    meta = PickleShmMetadata(
        tensor_meta=[(torch.Size([2, 3]), torch.bfloat16), ((), torch.bool)],
        tensor_device="cpu",
        extra={
            "blob": b"\x00\xff",
            3: (1, 2.5, None),
            "np": [
                np.dtype("float32"),
                np.float64(1.5),
                np.arange(6, dtype=np.int16).reshape(2, 3),
            ],
        },
        path="/dev/shm/rdplug-x",
    )
    frames: list[bytes] = []
    data = json.loads(json.dumps(_wire.encode_value(meta, frames)))  # what the wire carries
    back = _wire.decode_value(data, frames, metadata_classes())
    assert type(back) is PickleShmMetadata and back.path == meta.path
    assert back.tensor_meta == meta.tensor_meta and back.extra["blob"] == meta.extra["blob"]
    assert back.extra[3] == (1, 2.5, None)
    np_dtype, scalar, array = back.extra["np"]
    assert np_dtype == np.dtype("float32") and scalar == 1.5
    assert array.tolist() == [[0, 1, 2], [3, 4, 5]] and array.dtype == np.int16
