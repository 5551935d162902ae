"""The stream port under bad input, in this process (no Ray): each refusal comes
before any ticket is honoured and leaves nothing held (``_stream_server``).

A certificate from another CA, no certificate where mutual TLS is on, plaintext
to the TLS port, a handshake that never completes, a replayed request, a ticket
named from another connection; a full port: idle connections evicted first,
then ``BUSY``, retried within the consumer's deadline, else ``TransferError``
naming the producer."""

from __future__ import annotations

import datetime
import socket
import ssl
import threading
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

import raydirect as rd
from raydirect import _frames, _stream_client, _stream_server, _tls
from raydirect._stream_server import CHALLENGE_BYTES, MAGIC, REQUEST, StreamServer, proof

from helpers import wait_for

HOST = "127.0.0.1"
DATA = bytes(range(256)) * 4096  # 1 MiB


# ------------------------------------------------------------------ helpers


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer: str, issuer_key, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    return builder.sign(issuer_key, hashes.SHA256())


def make_ca(folder: Path, name: str, nodes: int = 1) -> list[dict[str, str]]:
    """A CA and ``nodes`` certificates it signed, each node's as Ray's three TLS
    variables."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert(f"{name}-ca", ca_key, f"{name}-ca", ca_key, ca=True)
    pem = serialization.Encoding.PEM
    ca_path = folder / f"{name}-ca.crt"
    ca_path.write_bytes(ca.public_bytes(pem))
    envs = []
    for node in range(nodes):
        key = ec.generate_private_key(ec.SECP256R1())
        leaf = _cert(f"{name}-node{node}", key, f"{name}-ca", ca_key, ca=False)
        cert_path, key_path = folder / f"{name}{node}.crt", folder / f"{name}{node}.key"
        cert_path.write_bytes(leaf.public_bytes(pem))
        key_path.write_bytes(
            key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
        envs.append(
            {
                "RAY_TLS_SERVER_CERT": str(cert_path),
                "RAY_TLS_SERVER_KEY": str(key_path),
                "RAY_TLS_CA_CERT": str(ca_path),
            }
        )
    return envs


def use(monkeypatch, env: dict[str, str] | None) -> None:
    for name in _tls.RAY_FILES:
        if env is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, env[name])


def serve(security: _tls.ServerSecurity | None = None) -> tuple[StreamServer, bytes, bytes]:
    server = StreamServer(HOST, security)
    ticket, secret, _ = server.issue([memoryview(DATA)])
    return server, ticket, secret


def read(server: StreamServer, ticket: bytes, secret: bytes, pin: str | None, deadline=10.0):
    dest = bytearray(len(DATA))
    peer = _stream_client.Peer((HOST, server.port), pin, "Producer.test (pid 1 on here)")
    _stream_client.receive(
        peer, ticket, secret, [memoryview(dest)], time.monotonic() + deadline, lambda: None
    )
    return bytes(dest)


def nothing_held(server: StreamServer) -> None:
    """No connection left open on the server once the consumer's pool is closed
    (each refused one was closed by the server)."""
    _stream_client.close_idle()
    wait_for(lambda: sum(server.connections().values()) == 0, timeout=10, what="closed")


def raw_request(conn: socket.socket, ticket: bytes, secret: bytes, offset=0, length=16) -> bytes:
    """Read READY and the challenge, send a request with a proof from ``secret``;
    return the request's bytes."""
    assert conn.recv(1) == _stream_server.READY
    challenge = _recv(conn, CHALLENGE_BYTES)
    mac = proof(secret, challenge, ticket, offset, length)
    request = REQUEST.pack(MAGIC, ticket, offset, length, mac)
    conn.sendall(request)
    return request


def _recv(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        assert chunk, "closed early"
        data += chunk
    return data


def status_then_close(conn: socket.socket) -> int:
    status = conn.recv(1)
    assert status
    assert conn.recv(1) == b""  # and the server hung up
    return status[0]


# ------------------------------------------------------------------ clear


def test_a_replayed_request_is_refused():
    """The request bytes of a real window, sent again on another connection: its
    challenge differs, so the proof fails; the ticket stays for its consumer."""
    server, ticket, secret = serve()
    with socket.create_connection((HOST, server.port), timeout=10) as first:
        request = raw_request(first, ticket, secret)
        assert first.recv(1) == bytes([_stream_server.OK])
        assert _recv(first, 16) == DATA[:16]
    with socket.create_connection((HOST, server.port), timeout=10) as replay:
        assert replay.recv(1) == _stream_server.READY
        _recv(replay, CHALLENGE_BYTES)
        replay.sendall(request)
        assert status_then_close(replay) == _stream_server.BAD_PROOF
    assert server.refused["bad proof"] == 1
    assert read(server, ticket, secret, None)[16:] == DATA[16:]  # the consumer still can
    nothing_held(server)


def test_a_ticket_named_from_another_connection_is_refused():
    """Someone who saw the ticket's id (not its secret, which only the consumer that
    asked has) gets nothing."""
    server, ticket, secret = serve()
    with socket.create_connection((HOST, server.port), timeout=10) as thief:
        raw_request(thief, ticket, b"x" * 16)
        assert status_then_close(thief) == _stream_server.BAD_PROOF
    assert server.pending() == 1
    assert read(server, ticket, secret, None) == DATA
    wait_for(lambda: server.pending() == 0, what="the ticket used up")
    nothing_held(server)


# ------------------------------------------------------------------ TLS


@pytest.fixture
def self_made(monkeypatch):
    use(monkeypatch, None)
    return _tls.server_security()


def test_encrypted_reads_are_exact_and_pinned(self_made):
    server, ticket, secret = serve(self_made)
    assert server.encryption == _tls.TLS and len(self_made.pin) == 64
    with pytest.raises(rd.TransferError, match="certificate other than"):
        read(server, ticket, secret, "0" * 64)  # someone else's certificate: not ours
    assert server.pending() == 1
    assert read(server, ticket, secret, self_made.pin) == DATA
    nothing_held(server)


@pytest.mark.parametrize("records", ["frames", "tls"])
def test_each_record_layer_moves_the_bytes(monkeypatch, records):
    use(monkeypatch, None)
    monkeypatch.setenv(_tls.RECORDS_ENV, records)
    security = _tls.server_security()
    server, ticket, secret = serve(security)
    assert read(server, ticket, secret, security.pin) == DATA
    nothing_held(server)


@pytest.mark.parametrize("records", ["tls", "frames"])
def test_a_pooled_tls_records_link_is_retired_past_one_keys_bytes(monkeypatch, records):
    """Python's ssl cannot update a TLS 1.3 session's keys, so a pooled connection
    in TLS records is retired once it carried what one AES-GCM key should protect
    (RFC 8446 5.5; lowered to two windows here): the third read opens a new
    connection, with new keys. Frames ratchet their own keys: kept (the control)."""
    use(monkeypatch, None)
    monkeypatch.setenv(_tls.RECORDS_ENV, records)
    monkeypatch.setattr(_frames, "_TLS_BYTES_PER_KEY", 2 * len(DATA), raising=False)
    security = _tls.server_security()
    server = StreamServer(HOST, security)
    _stream_client.close_idle()
    opened = _stream_client.counters["connections"]
    for _ in range(3):
        ticket, secret, _ = server.issue([memoryview(DATA)])
        assert read(server, ticket, secret, security.pin) == DATA
    assert _stream_client.counters["connections"] - opened == (2 if records == "tls" else 1)
    nothing_held(server)


def test_plaintext_to_the_tls_port_is_refused(self_made):
    server, ticket, secret = serve(self_made)
    with socket.create_connection((HOST, server.port), timeout=10) as conn:
        assert conn.recv(1) == _stream_server.READY
        conn.sendall(REQUEST.pack(MAGIC, ticket, 0, 16, bytes(32)))
        try:  # a TLS alert at most, or a reset: never the challenge or a byte of DATA
            data = conn.recv(4096)
        except ConnectionResetError:
            data = b""
        assert DATA[:16] not in data
        wait_for(lambda: server.refused["tls"] == 1, what="TLS refusal")
    assert server.pending() == 1
    nothing_held(server)


def test_a_handshake_that_never_completes_is_closed(self_made, monkeypatch):
    monkeypatch.setattr(_stream_server, "FIRST_REQUEST_TIMEOUT_S", 0.5)
    server, ticket, secret = serve(self_made)
    started = time.monotonic()
    with socket.create_connection((HOST, server.port), timeout=10) as conn:
        assert conn.recv(1) == _stream_server.READY
        conn.sendall(b"\x16\x03\x01")  # the first bytes of a ClientHello, then nothing
        assert conn.recv(1) == b""  # closed by the server
    assert time.monotonic() - started < 5
    assert server.pending() == 1
    nothing_held(server)


def test_mutual_tls_refuses_another_ca_and_no_certificate(tmp_path, monkeypatch):
    [ours] = make_ca(tmp_path, "ours")
    [theirs] = make_ca(tmp_path, "theirs")
    use(monkeypatch, ours)
    security = _tls.server_security()
    assert _tls.ray_ca(security.pin)
    server, ticket, secret = serve(security)
    use(monkeypatch, theirs)  # a consumer whose certificate another CA signed
    with pytest.raises(rd.TransferError, match="TLS to the stream port"):
        read(server, ticket, secret, security.pin)
    wait_for(lambda: server.refused["tls"] >= 1, what="refused")
    # No certificate at all: a plain TLS client that trusts our CA.
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(ours["RAY_TLS_CA_CERT"])
    with socket.create_connection((HOST, server.port), timeout=10) as raw:
        assert raw.recv(1) == _stream_server.READY
        with pytest.raises((ssl.SSLError, ConnectionError)):
            tls = ctx.wrap_socket(raw)
            tls.recv(1)  # TLS 1.3: the server's refusal arrives after the client's finish
    wait_for(lambda: server.refused["tls"] >= 2, what="refused")
    assert server.pending() == 1
    use(monkeypatch, ours)
    assert read(server, ticket, secret, security.pin) == DATA
    nothing_held(server)


def test_under_a_ca_another_nodes_certificate_cannot_stand_in_for_a_stream_port(
    tmp_path, monkeypatch
):
    """Under Ray's TLS every node's certificate checks against the CA, so the
    address pins the producer's own certificate too: a node holding another
    certificate of the same CA that stands in for the producer's stream port (its
    address taken, or on the path) is refused before a ticket is named, and nobody
    reads with a pin the address does not give."""
    producer_node, other_node = make_ca(tmp_path, "ray", nodes=2)
    use(monkeypatch, producer_node)
    producer_pin = _tls.server_security().pin
    use(monkeypatch, other_node)
    impostor_security = _tls.server_security()
    impostor, ticket, secret = serve(impostor_security)
    use(monkeypatch, producer_node)  # the consumer: a node of the same cluster
    with pytest.raises(rd.TransferError, match="certificate other than"):
        read(impostor, ticket, secret, producer_pin)
    assert producer_pin.startswith(_tls.RAY_CA + "-") and len(producer_pin) == 3 + 64
    with pytest.raises(rd.TransferError, match="certificate other than"):
        read(impostor, ticket, secret, _tls.RAY_CA)  # an address naming no certificate
    assert impostor.pending() == 1  # no ticket was named
    assert read(impostor, ticket, secret, impostor_security.pin) == DATA  # its own address
    nothing_held(impostor)


# ------------------------------------------------------------------ a full port


def _stuck(server: StreamServer, ticket: bytes, secret: bytes) -> socket.socket:
    """A connection being served a window it never reads (SERVING until closed)."""
    conn = socket.create_connection((HOST, server.port), timeout=10)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw_request(conn, ticket, secret, 0, len(DATA) * 32)
    return conn


def test_a_full_port_evicts_idle_connections_then_says_busy(monkeypatch):
    monkeypatch.setattr(_stream_server, "MAX_CONNECTIONS", 2)
    monkeypatch.setattr(_stream_server, "UNPROVEN_S", 0.0)
    big = memoryview(DATA * 32)
    server = StreamServer(HOST)
    stuck_ticket, stuck_secret, _ = server.issue([big])
    _stream_client.close_idle()
    # Two served, now idle, pooled connections fill the port...
    idle = []
    for _ in range(2):
        ticket, secret, _ = server.issue([memoryview(DATA)])
        idle.append(socket.create_connection((HOST, server.port), timeout=10))
        raw_request(idle[-1], ticket, secret, 0, len(DATA))
        assert idle[-1].recv(1) == bytes([_stream_server.OK])
        assert _recv(idle[-1], len(DATA)) == DATA
    wait_for(lambda: server.connections()["idle"] == 2, what="two idle")
    # ... and a newcomer still gets in: the oldest idle one makes room.
    ticket, secret, _ = server.issue([memoryview(DATA)])
    assert read(server, ticket, secret, None) == DATA
    assert server.refused["evicted idle"] >= 1
    assert idle[0].recv(64)[:1] == b"" or idle[0].recv(64) == b""  # the oldest was shut
    _stream_client.close_idle()
    for conn in idle:
        conn.close()
    # Every connection mid-transfer: the newcomer is told busy, retries until its
    # deadline, then gets TransferError naming the producer.
    # One at a time: with UNPROVEN_S 0, a connection whose request the server has
    # not read yet is fair game for the next newcomer (on a loaded machine the
    # second evicted the first, and only one was ever serving).
    stuck = []
    for serving in (1, 2):
        stuck.append(_stuck(server, stuck_ticket, stuck_secret))
        wait_for(lambda n=serving: server.connections()["serving"] == n, what=f"{serving} serving")
    busy_before = _stream_client.counters["busy"]
    ticket, secret, _ = server.issue([memoryview(DATA)])
    started = time.monotonic()
    with pytest.raises(rd.TransferError, match="Producer.test .* stayed busy"):
        read(server, ticket, secret, None, deadline=1.5)
    assert time.monotonic() - started < 1.5 + 1.0
    assert _stream_client.counters["busy"] > busy_before + 1  # it did retry
    # Retried within the deadline: a slot frees while the consumer backs off.
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(read(server, ticket, secret, None, 20)))
    reader.start()
    wait_for(lambda: _stream_client.counters["busy"] > busy_before + 4, what="more busy answers")
    stuck[0].close()
    reader.join(30)
    assert got == [DATA]
    stuck[1].close()
    nothing_held(server)
