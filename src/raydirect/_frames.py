"""One stream connection after its set-up: in clear, in TLS records, or in
AES-256-GCM frames (see ``_tls`` for which and why).

``Link`` is what ``_stream_server`` and ``_stream_client`` talk through: small
messages (``send``, ``recv_exactly``) and a window's bytes (``send_pieces``,
``recv_pieces``), each filling or sending exactly what was asked, or raising
``ConnectionError`` (the peer closed, or sent what it must not) or
``TimeoutError`` (from the socket's timeout). The client passes ``check``, called
at each timeout, to watch the producer, and ``between``, called after every
receive while a window's bytes flow, to stop at once when its call gives up or
its deadline passes (a few ms: one ``recv_into``, not an idle socket's timeout).

Frames (``FramedLink``): a 4-byte little-endian length (at most ``FRAME_BYTES``:
a longer one is refused before anything is read into memory), then the
ciphertext and its 16-byte tag. A frame is decrypted into the link's buffer and
reaches the caller's memory only once its tag has checked. The length is the
frame's associated data, the nonce the direction and a counter, so a frame
cannot be cut, reordered, replayed or moved to the other direction without the
tag failing. One key per connection and direction, from 32 random bytes of
each side exchanged inside the TLS session (``frame_key``), ratcheted every
``_FRAMES_PER_KEY`` frames (``_DirectionKey``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import ssl
import struct
from collections.abc import Callable
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from raydirect._tls import (
    FRAMES,
    KTLS,
    TLS,
    ServerSecurity,
    check_pin,
    client_context,
    ktls_active,
)

FRAME_BYTES = 1 << 20
_RECV_BYTES = 16 << 20  # per recv_into call: bounded time between deadline checks
_DIRECT_BYTES = 64 << 10  # pieces this large are sealed straight from their memory
_LENGTH = struct.Struct("<I")
_TAG = 16
TO_CLIENT, TO_SERVER = 0, 1
# RFC 8446 5.5: at most 2^34.5 AES-GCM blocks under one key (2^24.5 full TLS records).
# A direction's frame key ratchets every _FRAMES_PER_KEY frames of at most 2^16 + 1
# blocks: 2^32 blocks a key at most. TLS records (``ssl`` offers no key update) are
# retired from the pool once _TLS_BYTES_PER_KEY (2^32 blocks) went through them.
_FRAMES_PER_KEY = 1 << 16
_TLS_BYTES_PER_KEY = 1 << 36

Check = Callable[[], None]


def _no_check() -> None:
    return None


def frame_key(server_random: bytes, client_random: bytes) -> bytes:
    return hmac.new(server_random, b"raydirect frames v1" + client_random, hashlib.sha256).digest()


def recv_exactly_into(
    sock: Any, view: memoryview, check: Check = _no_check, between: Check = _no_check
) -> None:
    """Fill ``view`` from ``sock`` (a socket or an SSL socket); ``check`` at each
    timeout, ``between`` after each receive that left bytes to come."""
    while len(view):
        try:
            got = sock.recv_into(view, min(len(view), _RECV_BYTES))
        except TimeoutError:
            check()
            continue
        if got == 0:
            raise ConnectionError("the peer closed the stream midway")
        view = view[got:]
        if len(view):
            between()


class Link:
    """Clear bytes, or TLS records (``sock`` an ``ssl.SSLSocket``)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.received = 0  # window bytes received so far

    def worn_out(self) -> bool:
        """Should the link be retired rather than pooled? TLS records past the bytes
        one key should protect (a new connection has new keys); never in clear."""
        return isinstance(self.sock, ssl.SSLSocket) and self.received >= _TLS_BYTES_PER_KEY

    def settimeout(self, seconds: float | None) -> None:
        self.sock.settimeout(seconds)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv_exactly(self, size: int, check: Check = _no_check) -> bytes:
        buf = bytearray(size)
        recv_exactly_into(self.sock, memoryview(buf), check)
        return bytes(buf)

    def send_pieces(self, pieces: list[memoryview]) -> None:
        for piece in pieces:
            self.sock.sendall(piece)

    def recv_pieces(
        self, pieces: list[memoryview], check: Check = _no_check, between: Check = _no_check
    ) -> None:
        unchecked = 0  # bytes of whole pieces since ``between`` last ran
        for piece in pieces:
            recv_exactly_into(self.sock, piece, check, between)
            unchecked += len(piece)
            if unchecked >= FRAME_BYTES:  # small pieces, one recv each: now and then
                between()
                unchecked = 0
        self.received += sum(len(p) for p in pieces)

    def close(self) -> None:
        self.sock.close()


class _DirectionKey:
    """One direction's AES-256-GCM key, ratcheted (HMAC-SHA256 of itself) every
    ``_FRAMES_PER_KEY`` frames. Both ends count the direction's frames, so they
    ratchet in step without a message; the old key is forgotten."""

    def __init__(self, key: bytes, direction: int) -> None:
        self._key = hmac.new(key, b"raydirect frames direction %d" % direction, hashlib.sha256)
        self.aead = AESGCM(self._key.digest())
        self._direction = direction
        self._limit = _FRAMES_PER_KEY
        self.frames = 0
        self.keys = 1  # keys used so far

    def nonce(self) -> bytes:
        return struct.pack("<IQ", self._direction, self.frames)

    def used(self) -> None:
        """One more frame sealed, or opened and authenticated, under the key."""
        self.frames += 1
        if self.frames % self._limit == 0:
            self._key = hmac.new(self._key.digest(), b"raydirect frames next key", hashlib.sha256)
            self.aead = AESGCM(self._key.digest())
            self.keys += 1


class FramedLink(Link):
    """AES-256-GCM frames over a plain socket, after a TLS handshake gave the key."""

    def __init__(self, sock: socket.socket, key: bytes, server: bool) -> None:
        super().__init__(sock)
        out_dir, in_dir = (TO_CLIENT, TO_SERVER) if server else (TO_SERVER, TO_CLIENT)
        self.out_key, self.in_key = _DirectionKey(key, out_dir), _DirectionKey(key, in_dir)
        self._sealed = bytearray(_LENGTH.size + FRAME_BYTES + _TAG)
        self._plain = bytearray(FRAME_BYTES)  # small pieces gathered into one frame
        self._staged = 0

    def worn_out(self) -> bool:
        return False  # its keys ratchet

    # -- sending
    def _seal(self, data: memoryview) -> None:
        n = len(data)
        length = _LENGTH.pack(n)
        sealed = memoryview(self._sealed)
        sealed[: _LENGTH.size] = length
        end = _LENGTH.size + n + _TAG
        key = self.out_key
        key.aead.encrypt_into(key.nonce(), data, length, sealed[_LENGTH.size : end])
        key.used()
        self.sock.sendall(sealed[:end])

    def _flush(self) -> None:
        if self._staged:
            staged, self._staged = self._staged, 0
            self._seal(memoryview(self._plain)[:staged])

    def send(self, data: bytes) -> None:
        self.send_pieces([memoryview(data)])

    def send_pieces(self, pieces: list[memoryview]) -> None:
        plain = memoryview(self._plain)
        for piece in pieces:
            while len(piece):
                if self._staged == 0 and len(piece) >= _DIRECT_BYTES:
                    take = min(len(piece), FRAME_BYTES)
                    self._seal(piece[:take])
                else:
                    take = min(len(piece), FRAME_BYTES - self._staged)
                    plain[self._staged : self._staged + take] = piece[:take]
                    self._staged += take
                    if self._staged == FRAME_BYTES:
                        self._flush()
                piece = piece[take:]
        self._flush()

    # -- receiving
    def _open(self, check: Check, room: int, between: Check) -> tuple[memoryview, int]:
        """Read one frame's sealed bytes (at most ``room`` plain bytes): (ciphertext
        with tag, plain length)."""
        sealed = memoryview(self._sealed)
        recv_exactly_into(self.sock, sealed[: _LENGTH.size], check)
        (n,) = _LENGTH.unpack(sealed[: _LENGTH.size])
        if n > min(room, FRAME_BYTES) or n == 0:
            raise ConnectionError(f"corrupt stream: a frame of {n} bytes where {room} are due")
        body = sealed[_LENGTH.size : _LENGTH.size + n + _TAG]
        recv_exactly_into(self.sock, body, check, between)
        return body, n

    def _decrypt(self, body: memoryview, n: int, out: memoryview) -> None:
        try:
            self.in_key.aead.decrypt_into(self.in_key.nonce(), body, _LENGTH.pack(n), out)
        except InvalidTag:
            raise ConnectionError("corrupt stream: a frame failed authentication") from None
        self.in_key.used()

    def recv_exactly(self, size: int, check: Check = _no_check) -> bytes:
        buf = bytearray(size)
        self.recv_pieces([memoryview(buf)], check)
        return bytes(buf)

    def recv_pieces(
        self, pieces: list[memoryview], check: Check = _no_check, between: Check = _no_check
    ) -> None:
        """Each frame is decrypted into the link's own buffer and copied to ``pieces``
        only once its tag has checked: ``decrypt_into`` writes the plaintext before it
        checks the tag and leaves it there when the check fails, so decrypting
        straight into the caller's memory would leave an on-path attacker's bit
        flips in it (in live weights, say). After a failure each piece holds
        authenticated bytes where earlier frames landed and its old bytes elsewhere.
        The copy is of a buffer in cache: encrypted reads of 512 MiB went from 0.65x
        of clear to 0.61x on loopback here (docs/cluster.md)."""
        pieces = [p for p in pieces if len(p)]
        room = sum(len(p) for p in pieces)
        plain = memoryview(self._plain)
        i = 0  # pieces[i] is the unfilled rest of the piece being filled
        while i < len(pieces):
            body, n = self._open(check, room, between)
            between()
            room -= n
            self._decrypt(body, n, plain[:n])
            pos = 0
            while pos < n:
                take = min(len(pieces[i]), n - pos)
                pieces[i][:take] = plain[pos : pos + take]
                pieces[i] = pieces[i][take:]
                pos += take
                if not len(pieces[i]):
                    i += 1


# ------------------------------------------------------------------ set-up

_RANDOM = 32
_LAYERS = {0: "frames", 1: "tls", 2: "ktls"}  # the byte the server sends, inside TLS


def secure_server(raw: socket.socket, security: ServerSecurity) -> tuple[Link, str]:
    """TLS on an accepted connection (``raw``'s timeout bounds each step), then the
    record layer the server chose: (the link, what it is: tls or ktls)."""
    tls = security.context.wrap_socket(raw, server_side=True)
    layer = security.records
    if layer == KTLS and not ktls_active(tls):
        layer = FRAMES  # the kernel refused this connection: tell the consumer
    code = next(k for k, v in _LAYERS.items() if v == layer)
    server_random = os.urandom(_RANDOM)
    tls.sendall(bytes([code]) + server_random)
    client_random = bytearray(_RANDOM)
    recv_exactly_into(tls, memoryview(client_random))
    if layer != FRAMES:
        return Link(tls), KTLS if layer == KTLS else TLS
    plain = tls.unwrap()
    return FramedLink(plain, frame_key(server_random, bytes(client_random)), server=True), TLS


def secure_client(raw: socket.socket, pin: str) -> Link:
    """TLS to a producer's stream port whose address carries ``pin`` (``raw``'s
    timeout bounds each step), then the record layer the server names."""
    tls = client_context(pin).wrap_socket(raw)
    check_pin(tls, pin)
    head = bytearray(1 + _RANDOM)
    recv_exactly_into(tls, memoryview(head))
    layer = _LAYERS.get(head[0])
    if layer is None:
        raise ConnectionError(f"the stream port named an unknown record layer ({head[0]})")
    client_random = os.urandom(_RANDOM)
    tls.sendall(client_random)
    if layer != FRAMES:
        return Link(tls)
    plain = tls.unwrap()
    return FramedLink(plain, frame_key(bytes(head[1:]), client_random), server=False)
