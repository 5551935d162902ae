"""Metadata blobs, compressed when large enough to pay for it.

An object of thousands of tensors carries its names, shapes and addresses in
its Payload; compressed, they stay under the 100 KiB that Ray returns inline in
a task's reply (above that the Payload goes through Ray's object store, ~2.5 ms
more a step). A small blob is sent as it is: starting a zlib stream costs tens
of microseconds, more than a small object's whole export.
"""

from __future__ import annotations

import zlib

_COMPRESS_FROM = 4096  # bytes; below, a blob is sent raw
_RAW, _ZLIB = b"\x00", b"\x01"


def pack(raw: bytes) -> bytes:
    """``raw`` tagged, and compressed when it is at least a few KiB."""
    if len(raw) < _COMPRESS_FROM:
        return _RAW + raw
    return _ZLIB + zlib.compress(raw, 1)


def unpack(blob: bytes) -> bytes:
    """What ``pack`` was given; ``ValueError`` for anything ``pack`` did not make."""
    tag, body = blob[:1], blob[1:]
    if tag == _RAW:
        return body
    if tag == _ZLIB:
        try:
            return zlib.decompress(body)
        except zlib.error as exc:
            raise ValueError(f"corrupt compressed metadata: {exc}") from exc
    raise ValueError("metadata without a known tag")
