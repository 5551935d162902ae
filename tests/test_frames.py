"""AES-GCM frames over a real socket pair: a window of many pieces of mixed sizes
arrives whole, frames landing inside one piece and spanning many alike."""

from __future__ import annotations

import os
import random
import socket
import threading

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
