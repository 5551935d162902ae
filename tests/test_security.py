"""The control channel: bound to the node's address, capability-checked, robust to garbage."""

from __future__ import annotations

import hashlib
import json
import secrets
import socket
import threading

import pytest
import ray
import torch
import zmq

import raydirect as rd
from raydirect import _channel, _wire

from actors import Producer, check_value
from helpers import agent_dealer, wait_for


def agent_address(actor) -> str:
    return ray.get(
        actor.__ray_call__.remote(
            lambda self: __import__("raydirect._runtime", fromlist=["agent"]).agent().address
        )
    )


@pytest.fixture(scope="module")
def producer(ray_session):
    p = Producer.remote()
    yield p
    ray.kill(p)


# A context of the test's own: what is checked is the agent, not this process's channels.
_CONTEXT = zmq.Context()


def request(**fields: object) -> bytes:
    """A request as a raydirect process would send it."""
    return json.dumps(fields).encode()


def dealer(address: str, keys: tuple[bytes, bytes] | None = None) -> zmq.Socket:
    """A DEALER to the agent, with the cluster's CURVE key (or ``keys``)."""
    return agent_dealer(_CONTEXT, address, keys)


def ask(address: str, *frames: bytes) -> dict:
    sock = dealer(address)
    try:
        sock.send_multipart(list(frames))
        assert sock.poll(60_000), "the agent did not answer"
        return json.loads(sock.recv_multipart()[0])
    finally:
        sock.close()


def test_agent_listens_on_the_node_address_only(producer):
    address = agent_address(producer)
    assert address.startswith(f"tcp://{ray.util.get_node_ip_address()}:")
    assert "0.0.0.0" not in address and "127.0.0.1" not in address
    assert _wire.CURVE_MARK in address  # the control channel is CURVE-only, always


def test_requests_without_the_right_capability_are_refused(producer):
    address = agent_address(producer)
    ref = producer.keep.remote("sec")
    ray.wait([ref])
    [obj_hex] = ray.get(
        producer.__ray_call__.remote(
            lambda self: [
                k.hex() for k in __import__("raydirect._store", fromlist=["store"]).store._objects
            ]
        )
    )
    for cap in (secrets.token_hex(16), "", "00" * 16):
        reply = ask(address, request(op="fetch", obj=obj_hex, cap=cap, transport="tcp"))
        assert reply["ok"] is False and reply["kind"] == "lost"
    for garbage in (
        b"\xff\x00garbage",
        request(),
        request(op="fetch"),
        request(op="fetch", obj="zz", cap="zz"),
    ):
        reply = ask(address, garbage)
        assert reply["ok"] is False and reply["kind"] == "bad_request"
    reply = ask(address, b"[1, 2]")  # valid JSON, not a request
    assert reply["kind"] == "bad_request"
    # The agent survived all of it and still serves the real holder of the ref.
    assert rd.get(ref, timeout=30, tensor_transport="tcp").tolist() == list(range(20_000))
    assert check_value("dtypes", rd.get(producer.value.remote("dtypes"), timeout=30)) is None


def _objects(actor) -> dict[str, str]:
    """Object id -> capability (hex) of what ``actor`` holds (read from its store)."""
    return ray.get(
        actor.__ray_call__.remote(
            lambda self: {
                k.hex(): o.capability.hex()
                for k, o in __import__(
                    "raydirect._store", fromlist=["store"]
                ).store._objects.items()
            }
        )
    )


def _new_object(actor, key: str) -> tuple[ray.ObjectRef, str, str]:
    """``actor.keep(key)``'s ref, and the id and capability of the object it made:
    not an earlier test's, whose ref is gone and which may be freed meanwhile."""
    before = _objects(actor)
    ref = actor.keep.remote(key)
    ray.wait([ref])
    [(obj_hex, cap_hex)] = [(k, c) for k, c in _objects(actor).items() if k not in before]
    return ref, obj_hex, cap_hex


def _capture_logs(actor) -> None:
    def install(self):
        import logging

        class Keep(logging.Handler):
            def emit(self, record):
                kept.append(record.getMessage())

        kept: list[str] = []
        self.__dict__["_kept_logs"] = kept
        logging.getLogger("raydirect").addHandler(Keep(logging.DEBUG))

    ray.get(actor.__ray_call__.remote(install))


def _logs(actor) -> list[str]:
    return ray.get(actor.__ray_call__.remote(lambda self: list(self.__dict__["_kept_logs"])))


def test_agent_socket_is_bound_to_the_node_address(producer):
    """The listening socket itself, as the kernel reports it, not just the address string."""
    import psutil

    address = agent_address(producer)
    port = int(_wire.parse_address(address).endpoint.rsplit(":", 1)[1])
    pid = ray.get(producer.pid.remote())
    listening = [
        c.laddr
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]
    assert [a.ip for a in listening] == [ray.util.get_node_ip_address()], listening


def test_refusals_are_logged_without_capabilities(producer):
    address = agent_address(producer)
    _capture_logs(producer)
    ref, obj_hex, cap_hex = _new_object(producer, "logged")
    wrong = secrets.token_hex(16)
    freed_ref, freed_hex, freed_cap = _new_object(producer, "freed")
    del freed_ref
    wait_for(lambda: freed_hex not in _objects(producer), what="object freed")

    asks = {
        "wrong capability": request(op="fetch", obj=obj_hex, cap=wrong, transport="tcp"),
        "no capability": request(op="fetch", obj=obj_hex, transport="tcp"),
        "freed object": request(op="fetch", obj=freed_hex, cap=freed_cap, transport="tcp"),
    }
    kinds = {why: ask(address, raw)["kind"] for why, raw in asks.items()}
    assert kinds == {
        "wrong capability": "lost",
        "no capability": "bad_request",
        "freed object": "lost",
    }
    logs = wait_for(lambda: [m for m in _logs(producer) if "refused" in m] or None)
    text = "\n".join(logs)
    assert f"for {obj_hex[:8]}" in text and "wrong capability" in text
    assert f"for {freed_hex[:8]}" in text and "no such object" in text
    assert "malformed request" in text and "KeyError" in text
    for secret in (cap_hex, wrong, freed_cap, obj_hex, freed_hex):
        assert secret not in text  # neither capabilities nor full object ids reach the log
        assert secret[8:24] not in text
    assert rd.get(ref, timeout=30, tensor_transport="tcp").tolist() == list(range(20_000))


def test_capabilities_are_128_bit_keyed_hashes_under_a_secret(ray_session):
    """A capability is a keyed BLAKE2b of the object's id and size, under a 256-bit
    key drawn from ``secrets`` once per process: nobody without the key can make
    one, and the producer can check one long after its object was freed (a late
    read notice) with nothing remembered."""
    from raydirect import _store

    refs = [rd.put({"t": torch.ones(20_000)}) for _ in range(8)]  # 80 KB each: direct
    mine = [o for o in _store.store._objects.values() if o.nbytes == 80_000][-8:]
    capabilities = [o.capability for o in mine]
    assert len(capabilities) == 8 and len(set(capabilities)) == 8
    assert all(len(c) == 16 for c in capabilities)  # 128 bits
    assert isinstance(_store._KEY, bytes) and len(_store._KEY) == 32
    for o in mine:
        assert o.capability == _store.capability_of(o.obj_id, o.nbytes)
        unkeyed = hashlib.blake2b(o.obj_id + o.nbytes.to_bytes(8, "little"), digest_size=16)
        assert o.capability != unkeyed.digest()
        assert o.capability != _store.capability_of(o.obj_id, o.nbytes + 1)  # vouches for size
    del refs


def test_ray_token_auth_is_required_by_the_agent(producer):
    """Ray 2.60 turns token auth on for a local ray.init() (RAY_AUTH_MODE=token; the
    token in ~/.ray/auth_token, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH). Then the
    agent admits only the cluster's CURVE key, derived from the token: any other
    key fails the handshake, and not one message reaches the agent."""
    if _wire.cluster_keys() is None:
        pytest.skip("Ray token authentication is off in this session (RAY_AUTH_MODE)")
    address = agent_address(producer)
    worker_keys = ray.get(
        producer.__ray_call__.remote(
            lambda self: __import__("raydirect._wire", fromlist=["x"]).cluster_keys()
        )
    )
    assert worker_keys == _wire.cluster_keys()  # every process of the cluster derives it
    token = ray._raylet.AuthenticationTokenLoader.instance().get_raw_token()
    assert token.encode() not in b"".join(worker_keys)  # a digest of the token, never it
    ref, obj_hex, cap_hex = _new_object(producer, "token")
    fetch = request(op="fetch", obj=obj_hex, cap=cap_hex, transport="tcp")
    handled = _handled(producer)
    for keys in (zmq.curve_keypair(), zmq.curve_keypair()):  # other clusters', or nobody's
        sock = dealer(address, keys)
        try:
            sock.send(fetch)
            assert not sock.poll(3000), "an agent answered a stranger"
        finally:
            sock.close()
    assert _handled(producer) == handled  # nothing reached a handler
    assert ask(address, fetch)["ok"] is True  # the cluster's key: served


def _handled(actor) -> int:
    """Requests the agent's admission let through so far (none from strangers)."""
    return ray.get(
        actor.__ray_call__.remote(
            lambda self: __import__("raydirect._runtime", fromlist=["x"]).agent().admission.admitted
        )
    )


def test_a_process_without_the_token_sees_a_clear_error(producer):
    if _wire.cluster_keys() is None:
        pytest.skip("Ray token authentication is off in this session (RAY_AUTH_MODE)")
    ref = producer.value_tcp.remote("dtypes")
    ray.wait([ref])
    original = _wire.client_keys
    stranger = zmq.curve_keypair()
    _forget_channels()
    _wire.client_keys = lambda: stranger  # as a process of another cluster
    try:
        with pytest.raises(rd.TransferError, match="refused this process.*cluster's token"):
            rd.get(ref, timeout=30, tensor_transport="tcp")
    finally:
        _wire.client_keys = original
        _forget_channels()
    assert check_value("dtypes", rd.get(ref, timeout=30, tensor_transport="tcp")) is None


def _forget_channels() -> None:
    """Close this thread's cached channels (the next read opens new ones)."""
    cache = _channel._channels.channels
    while cache:
        cache.popitem()[1].close()


def test_a_replayed_connection_is_not_served(producer):
    """Every byte a real consumer sent to the agent, recorded on the way (a proxy)
    and replayed on a new connection: CURVE's per-connection keys make it junk,
    and no request reaches a handler."""
    address = agent_address(producer)
    parts = _wire.parse_address(address)
    host, port = parts.host, int(parts.endpoint.rsplit(":", 1)[1])
    recorded = bytearray()
    listener = socket.create_server((ray.util.get_node_ip_address(), 0))

    def proxy() -> None:
        client, _ = listener.accept()
        upstream = socket.create_connection((host, port))
        done = threading.Event()

        def pump(src, dst, keep) -> None:
            try:
                while data := src.recv(65536):
                    if keep:
                        recorded.extend(data)
                    dst.sendall(data)
            except OSError:
                pass
            done.set()

        threading.Thread(target=pump, args=(upstream, client, False), daemon=True).start()
        pump(client, upstream, True)
        done.wait(5)
        client.close()
        upstream.close()

    thread = threading.Thread(target=proxy, daemon=True)
    thread.start()
    proxied = address.replace(
        parts.endpoint, f"tcp://{listener.getsockname()[0]}:{listener.getsockname()[1]}"
    )
    ref, obj_hex, cap_hex = _new_object(producer, "replayed")
    reply = ask(proxied, request(op="fetch", obj=obj_hex, cap=cap_hex, transport="tcp"))
    assert reply["ok"] is True and recorded, reply
    thread.join(10)
    handled = _handled(producer)
    with socket.create_connection((host, port), timeout=10) as replay:
        replay.sendall(bytes(recorded))
        replay.settimeout(3)
        got = b""
        try:
            while chunk := replay.recv(65536):
                got += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    assert cap_hex.encode() not in got and b'"ok": true' not in got
    assert _handled(producer) == handled  # the replay never became a request
    listener.close()


def test_the_agent_caps_its_connections_shedding_unproven_ones(ray_session):
    """Connections that never finish a handshake are shed once the agent holds more
    than its cap (the oldest still within their handshake window first), and a real
    consumer still gets through."""
    from raydirect._server import Server

    server = Server("127.0.0.1")
    server.connections.limit = 8
    silent = [socket.create_connection(("127.0.0.1", _port(server.address))) for _ in range(20)]
    try:
        wait_for(lambda: server.connections.shed >= 12, timeout=20, what="shed")
        assert len(server.connections) <= 8
        reply = _channel.request(server.address, {"op": "stats"}, timeout=20)
        assert reply["ok"] is True and "stats" in reply
        assert sum(map(_closed, silent)) >= 12  # the shed ones were shut by the agent
    finally:
        for conn in silent:
            conn.close()


def test_the_cap_skips_a_connection_gone_before_its_accept_was_read():
    """The agent reads a connection's addresses when its ACCEPTED event comes; a
    peer that left at once has its fd closed by then, which raised EBADF into the
    agent's loop ("unexpected error") and dropped the events after it."""
    from raydirect._gate import _peer_of

    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        conn, _ = listener.accept()
        fd = conn.fileno()
        assert _peer_of(fd) == (conn.getsockname(), conn.getpeername())
        conn.close()
        client.close()
        assert _peer_of(fd) is None


def _closed(conn: socket.socket) -> bool:
    """Did the peer close ``conn`` (after whatever greeting it sent)?"""
    conn.settimeout(0.5)
    try:
        while conn.recv(4096):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def _port(address: str) -> int:
    return int(_wire.parse_address(address).endpoint.rsplit(":", 1)[1])
