"""AES-GCM frames over a real socket pair: a window of many pieces of mixed sizes
arrives whole, frames landing inside one piece and spanning many alike."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import threading

from raydirect import _frames
from raydirect._frames import FRAME_BYTES, FramedLink


def _pair() -> tuple[FramedLink, FramedLink]:
    a, b = socket.socketpair()
    key = os.urandom(32)
    return FramedLink(a, key, server=True), FramedLink(b, key, server=False)


def test_a_window_of_many_mixed_pieces_arrives_whole():
    rng = random.Random(7)
    # Thousands of small pieces (gathered many to a frame, a frame spanning dozens),
    # empty ones, and pieces over a frame long (several frames straight into one).
    sizes = [rng.randrange(1, 400) for _ in range(6_000)] + [0, 3 * FRAME_BYTES + 17, 0, 5]
    sizes += [FRAME_BYTES - 1, 70_000, 2] * 3
    sent = [memoryview(os.urandom(n)) for n in sizes]
    got = [memoryview(bytearray(n)) for n in sizes]
    server, client = _pair()
    sender = threading.Thread(target=server.send_pieces, args=(sent,))
    sender.start()
    client.recv_pieces(list(got))
    sender.join(timeout=30)
    assert not sender.is_alive()
    assert all(bytes(g) == bytes(s) for g, s in zip(got, sent, strict=True))
    # The link stays in step for the next message.
    server.send(b"next")
    assert client.recv_exactly(4) == b"next"
    server.sock.close()
    client.sock.close()


def _wire_bytes(sender: FramedLink, tap: socket.socket, pieces: list[memoryview]) -> bytes:
    """What ``sender`` puts on the wire for ``pieces``, read raw from the other end."""
    sent = threading.Thread(target=sender.send_pieces, args=(pieces,))
    sent.start()
    expected = sum(4 + len(p) + 16 for p in pieces)  # one frame each (64 KiB: sealed directly)
    raw = bytearray()
    while len(raw) < expected:
        raw += tap.recv(expected - len(raw))
    sent.join(timeout=30)
    return bytes(raw)


def _receive(raw: bytes, key: bytes, sizes: list[int]) -> tuple[list[bytearray], Exception | None]:
    """Feed ``raw`` to a new receiving link; what it filled, and what it raised."""
    feed, end = socket.socketpair()

    def send() -> None:
        with contextlib.suppress(OSError):  # the receiver stops at a bad frame
            feed.sendall(raw)

    feeder = threading.Thread(target=send)
    feeder.start()
    got = [bytearray(n) for n in sizes]
    try:
        FramedLink(end, key, server=False).recv_pieces([memoryview(g) for g in got])
        error = None
    except ConnectionError as exc:
        error = exc
    end.close()
    feeder.join(timeout=30)
    feed.close()
    return got, error


def test_each_direction_rekeys_every_so_many_frames_and_the_peer_follows(monkeypatch):
    """A pooled link lives for many windows; past _FRAMES_PER_KEY frames its key
    ratchets (RFC 8446 5.5's limit on blocks per AES-GCM key), in step at both
    ends with no message. Lowered to 4 here: a peer that ratchets too reads all
    ten frames; one that never ratchets fails at the fifth, having written the four
    frames of the first key and nothing of the fifth."""
    monkeypatch.setattr(_frames, "_FRAMES_PER_KEY", 4, raising=False)
    key = os.urandom(32)
    pieces = [memoryview(os.urandom(64 << 10)) for _ in range(10)]
    a, tap = socket.socketpair()
    sender = FramedLink(a, key, server=True)
    raw = _wire_bytes(sender, tap, pieces)
    sizes = [len(p) for p in pieces]
    got, error = _receive(raw, key, sizes)
    assert error is None and [bytes(g) for g in got] == [bytes(p) for p in pieces]
    monkeypatch.setattr(_frames, "_FRAMES_PER_KEY", 1 << 40, raising=False)  # never ratchets
    got, error = _receive(raw, key, sizes)
    assert error is not None and "authentication" in str(error), "frame 5 opened with key 1"
    assert [bytes(g) for g in got[:4]] == [bytes(p) for p in pieces[:4]]
    assert not any(got[4]), "a frame that failed its tag reached the caller's memory"
    a.close()
    tap.close()
