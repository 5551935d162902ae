"""Workload 1's wire rows: what encryption adds, beside what the wire costs anyway.

``wire_floors`` times, in the driver, one plain TCP stream to itself and one core
sealing the same bytes with AES-256-GCM in 1 MiB frames: the two floors the
encrypted ``tcp`` rows (``TCP_ENCRYPTED``, ``TCP_TLS_RECORDS``) are read against.
"""

from __future__ import annotations

import socket
import threading
import time

import ray
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from rdbench.common import Row, format_size, run_row, seeds

TCP_ENCRYPTED = "raydirect tcp (encrypted, TLS)"
TCP_TLS_RECORDS = "raydirect tcp (encrypted, TLS records in user space)"
FLOOR_SOCKET = "floor: one TCP stream over the node address, no encryption"
FLOOR_SEAL = "floor: AES-256-GCM encrypt, one core (1 MiB frames)"


def wire_floors(nbytes: int, repeats: int) -> list[Row]:
    """What the wire costs in the driver: the bytes over one plain TCP connection
    to itself on the node's address (kernel copies in and out: what ``tcp`` in
    clear pays per stream), and an AES-256-GCM encryption of the same bytes in
    1 MiB frames on one core (what the encrypted stream pays on top, each side)."""
    src = bytearray(nbytes)
    dest = bytearray(nbytes)
    frame = 1 << 20
    sealed = bytearray(frame + 16)
    aead = AESGCM(AESGCM.generate_key(bit_length=256))

    def over_socket(seed: int) -> float:
        listener = socket.create_server((ray.util.get_node_ip_address(), 0))
        sender = threading.Thread(
            target=lambda: listener.accept()[0].sendall(memoryview(src)), daemon=True
        )
        sender.start()
        with socket.create_connection(listener.getsockname()) as conn:
            start = time.perf_counter()
            view = memoryview(dest)
            while len(view):
                view = view[conn.recv_into(view) :]
            seconds = time.perf_counter() - start
        sender.join()
        listener.close()
        return seconds

    def seal(seed: int) -> float:
        view = memoryview(src)
        start = time.perf_counter()
        for i, at in enumerate(range(0, nbytes, frame)):
            piece = view[at : at + frame]
            aead.encrypt_into(
                i.to_bytes(12, "little"), piece, None, memoryview(sealed)[: len(piece) + 16]
            )
        return time.perf_counter() - start

    param = format_size(nbytes)
    return [
        run_row(Row(1, FLOOR_SOCKET, param, nbytes, nbytes), repeats, over_socket, seeds()),
        run_row(Row(1, FLOOR_SEAL, param, nbytes, nbytes), repeats, seal, seeds()),
    ]
