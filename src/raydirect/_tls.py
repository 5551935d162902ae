"""Encryption of the bulk stream port: settings, certificates, TLS contexts.

When an agent encrypts (``encryption_wanted``: Ray's TLS on, or
``RAYDIRECT_ENCRYPT=1``), every connection to its stream port begins with a
TLS 1.3 handshake. Who trusts whom:

* Ray's own TLS files set (``RAY_TLS_SERVER_CERT``, ``RAY_TLS_SERVER_KEY``,
  ``RAY_TLS_CA_CERT``, as Ray's gRPC reads them): **mutual** TLS with them. The
  server asks for the client's certificate and both check the other's against
  Ray's CA: the trust Ray's own channels use, nothing new to configure. Any
  node's certificate checks against the CA, so the address also pins the
  producer's own (``/tls/ca-<sha-256 hex>``): another node cannot stand in for
  its stream port.
* ``RAYDIRECT_ENCRYPT=1`` without those files: the agent makes its own
  certificate (ECDSA P-256, one per process, never written anywhere but a
  private temporary directory while ``ssl`` loads it). Its SHA-256 fingerprint
  travels in the agent's address (``/tls/<hex>``), inside every ObjectRef's
  payload, as the CURVE key does: a consumer holding a ref pins that server.
  Consumers then present no certificate; the ticket proof (``_stream_server``)
  says which consumer asked.

After the handshake the bytes move in one of two record layers
(``RAYDIRECT_TLS_RECORDS``, read by the producer, which tells the consumer):

* ``frames`` (the default): the TLS session carries a fresh 256-bit key from
  each side, then closes (``unwrap``), and the window's bytes travel in
  AES-256-GCM frames of up to 1 MiB (``_frames``). Measured on the 2-core
  machine: Python's ``ssl`` moves 16 KiB TLS records at 1.1-1.4 GB/s per core
  (OpenSSL 3.0's per-record cost), AES-GCM itself runs at 4-6 GB/s per core in
  1 MiB frames (``cryptography``'s ``encrypt_into``), which is the cost kernel
  TLS would leave. Each direction's key ratchets every 65,536 frames.
* ``tls``: TLS 1.3 records end to end in user space (``ssl``, which cannot update
  a session's keys: the consumer retires a connection past 64 GiB, ``_frames``).
* ``ktls``: TLS 1.3 records handed to the kernel (``OP_ENABLE_KTLS``), where
  the Python build and kernel allow it; elsewhere the agent logs why once and
  uses ``frames``.

This module imports only the standard library and ``cryptography`` (a
dependency of Ray's, declared in ours).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import hmac
import logging
import os
import socket
import ssl
import tempfile
from dataclasses import dataclass

log = logging.getLogger("raydirect")

ENCRYPT_ENV = "RAYDIRECT_ENCRYPT"
ALLOW_CLEAR_ENV = "RAYDIRECT_ALLOW_CLEAR"
RECORDS_ENV = "RAYDIRECT_TLS_RECORDS"
RAY_FILES = ("RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")
TLS_MARK = "/tls/"  # in an agent address: /tls/ca-<sha-256 hex> (Ray's CA) or /tls/<sha-256 hex>
RAY_CA = "ca"  # a pin that starts with it: Ray's CA, then the certificate's fingerprint

# What an agent reports (LocalStats.encryption, raydirect status).
NONE, TLS, KTLS = "none", "tls", "ktls"
FRAMES, RECORDS = "frames", "tls"  # record layers after the handshake
_RECORD_LAYERS = (FRAMES, RECORDS, KTLS)
# OpenSSL's SSL_OP_ENABLE_KTLS (Python 3.12 names it ssl.OP_ENABLE_KTLS).
_OP_ENABLE_KTLS = getattr(ssl, "OP_ENABLE_KTLS", 1 << 3)
_TCP_ULP = 31  # setsockopt(IPPROTO_TCP, TCP_ULP, b"tls") attaches kernel TLS


def ray_tls_enabled() -> bool:
    return os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")


def encryption_wanted() -> bool:
    """Whether this process's agent encrypts its stream port (``RAYDIRECT_ENCRYPT``;
    unset: when Ray's TLS is on)."""
    raw = os.environ.get(ENCRYPT_ENV, "").strip().lower()
    if raw in ("", "auto"):
        return ray_tls_enabled()
    if raw in ("1", "true", "on", "yes"):
        return True
    if raw in ("0", "false", "off", "no"):
        return False
    raise ValueError(
        f"{ENCRYPT_ENV}={raw!r}: expected 1 (encrypt), 0 (do not), or unset it to "
        "encrypt exactly when Ray's TLS is on (RAY_USE_TLS=1)"
    )


def encryption_setting() -> str:
    """What makes this process encrypt (for messages)."""
    raw = os.environ.get(ENCRYPT_ENV, "").strip()
    if raw.lower() in ("", "auto"):
        return "Ray's TLS (RAY_USE_TLS=1)"
    return f"{ENCRYPT_ENV}={raw}"


def clear_allowed() -> bool:
    """``RAYDIRECT_ALLOW_CLEAR=1``: an encrypting process still reads bytes that cross
    from other nodes in clear (a mixed cluster); unset or 0: it refuses them."""
    raw = os.environ.get(ALLOW_CLEAR_ENV, "").strip().lower()
    if raw in ("", "0", "false", "off", "no"):
        return False
    if raw in ("1", "true", "on", "yes"):
        return True
    raise ValueError(
        f"{ALLOW_CLEAR_ENV}={raw!r}: expected 1 (an encrypting process may read clear bytes "
        "from other nodes) or 0 (it refuses them; the default)"
    )


def record_layer() -> str:
    """``RAYDIRECT_TLS_RECORDS``: frames (default), tls or ktls."""
    raw = os.environ.get(RECORDS_ENV, "").strip().lower() or FRAMES
    if raw not in _RECORD_LAYERS:
        raise ValueError(
            f"{RECORDS_ENV}={raw!r}: expected one of {', '.join(_RECORD_LAYERS)} "
            f"(or unset it: {FRAMES})"
        )
    return raw


def ray_files() -> tuple[str, str, str] | None:
    """Ray's TLS certificate, key and CA when all three are set, else None."""
    values = [os.environ.get(name, "").strip() for name in RAY_FILES]
    if all(values):
        return values[0], values[1], values[2]
    return None


@functools.cache
def ktls_unavailable() -> str | None:
    """Why kernel TLS cannot be used in this process, or None when it can."""
    if not hasattr(ssl, "OP_ENABLE_KTLS"):
        return f"this Python ({ssl.OPENSSL_VERSION}, Python < 3.12) does not offer OP_ENABLE_KTLS"
    try:
        with open("/proc/sys/net/ipv4/tcp_available_ulp") as f:
            ulps = f.read().split()
    except OSError:
        return "the kernel lists no TCP upper-layer protocols"
    if "tls" not in ulps:
        return "the kernel's tls module is not loaded (modprobe tls)"
    return None


def ktls_active(sock: socket.socket) -> bool:
    """Did OpenSSL hand this connection's records to the kernel?"""
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, _TCP_ULP, 16).rstrip(b"\0") == b"tls"
    except OSError:
        return False


def fingerprint(der: bytes) -> str:
    return hashlib.sha256(der).hexdigest()


def _self_signed() -> tuple[bytes, bytes]:
    """A fresh ECDSA P-256 key and self-signed certificate (PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "raydirect agent")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def _base_context(purpose: int) -> ssl.SSLContext:
    ctx = ssl.SSLContext(purpose)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3  # AES-GCM (or ChaCha20) suites only
    return ctx


@dataclass
class ServerSecurity:
    """An encrypting agent's TLS side of its stream port."""

    context: ssl.SSLContext
    pin: str  # what its address carries after TLS_MARK: ca-<fingerprint> or the fingerprint
    records: str  # FRAMES, RECORDS or KTLS: the record layer it serves

    @property
    def mode(self) -> str:
        return KTLS if self.records == KTLS else TLS


def _leaf_der(path: str) -> bytes:
    """The certificate a server presents from PEM file ``path``: its first."""
    with open(path) as f:
        text = f.read()
    start = text.index(ssl.PEM_HEADER)
    end = text.index(ssl.PEM_FOOTER, start) + len(ssl.PEM_FOOTER)
    return ssl.PEM_cert_to_DER_cert(text[start:end])


def server_security() -> ServerSecurity:
    """Mutual TLS with Ray's files where set, else a self-made certificate."""
    ctx = _base_context(ssl.PROTOCOL_TLS_SERVER)
    files = ray_files()
    if files is not None:
        cert, key, ca = files
        ctx.load_cert_chain(cert, key)
        ctx.load_verify_locations(ca)
        ctx.verify_mode = ssl.CERT_REQUIRED  # mutual: no certificate from Ray's CA, no stream
        pin = f"{RAY_CA}-{fingerprint(_leaf_der(cert))}"
    else:
        cert_pem, key_pem = _self_signed()
        with tempfile.TemporaryDirectory(prefix="raydirect-tls-") as folder:
            cert_path, key_path = os.path.join(folder, "c.pem"), os.path.join(folder, "k.pem")
            for path, data in ((cert_path, cert_pem), (key_path, key_pem)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
            ctx.load_cert_chain(cert_path, key_path)
        pin = fingerprint(ssl.PEM_cert_to_DER_cert(cert_pem.decode()))
    records = record_layer()
    if records == KTLS:
        why = ktls_unavailable()
        if why is None:
            ctx.options |= _OP_ENABLE_KTLS
        else:
            log.warning("raydirect: kernel TLS is unavailable (%s); using %s", why, FRAMES)
            records = FRAMES
    return ServerSecurity(ctx, pin, records)


def ray_ca(pin: str) -> bool:
    """Does ``pin`` name a server of Ray's CA (mutual TLS)?"""
    return pin == RAY_CA or pin.startswith(RAY_CA + "-")


def client_context(pin: str) -> ssl.SSLContext:
    """The consumer's TLS context for servers whose address carries ``pin``."""
    mutual = ray_ca(pin)
    return _client_context(mutual, ray_files() if mutual else None)


@functools.lru_cache(maxsize=8)
def _client_context(mutual: bool, files: tuple[str, str, str] | None) -> ssl.SSLContext:
    ctx = _base_context(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False  # nodes are named by address; trust is the CA and the pin
    if mutual:
        if files is None:
            raise ValueError(
                "the producer's stream port uses Ray's TLS certificates (mutual TLS), but "
                f"this process has none: set {', '.join(RAY_FILES)} as for Ray itself"
            )
        cert, key, ca = files
        ctx.load_cert_chain(cert, key)
        ctx.load_verify_locations(ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    else:
        ctx.verify_mode = ssl.CERT_NONE  # checked against the pin after the handshake
    return ctx


def check_pin(sock: ssl.SSLSocket, pin: str) -> None:
    """After the handshake (which checked a Ray CA server's chain): the server's
    certificate is the one the address names."""
    der = sock.getpeercert(binary_form=True) or b""
    want = pin.removeprefix(RAY_CA + "-") if ray_ca(pin) else pin
    if not hmac.compare_digest(fingerprint(der), want):
        raise ssl.SSLError(
            "the stream port presented a certificate other than the one its agent's "
            "address names (a different process now holds that port, or someone is "
            "in the middle)"
        )
