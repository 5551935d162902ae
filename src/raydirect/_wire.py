"""The control protocol's vocabulary: ops, message forms, the auth proof, and
what each refusal means to the consumer.

Every message is one ZeroMQ multipart message: a JSON header, then raw frames
(tensor bytes, or byte strings a header refers to). Nothing on the channel is
ever pickle: an agent is reachable from the network, and a consumer must not
run code a peer sends. Requests name an object (``obj``, hex) and carry its
128-bit capability (``cap``) from the Payload; where Ray's token
authentication is on they also carry ``auth``, a digest of the cluster's token.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import json
from typing import Any

import numpy as np
import torch
import zmq.utils.z85

from raydirect import _ray
from raydirect.errors import ProducerLostError, TransferError

# Ops, each owned (and registered with the server) by one layer above.
FETCH = "fetch"  # _producer: serve an object over a byte transport
META = "meta"  # _producer: transport metadata prepared in the background
SENT = "sent"  # _producer: a one-sided read finished (count it, check for writes)
ABORT = "abort"  # _producer: a plug-in transfer failed in the consumer
SEND = "send"  # _producer: run a two-sided plug-in's send_multiple_tensors
STATS = "stats"  # _runtime: this process's LocalStats (no tensor data, no capability)
GROUP_BROKEN = "group_broken"  # _group_api: a member saw the group fail
GROUP_LEAVE = "group_leave"  # _group_api: destroy the group in this member

# Fire-and-forget: a reply would sit unread in the sender's cached channel and
# be taken as the answer to its next request.
NOTIFY_OPS = frozenset({SENT, ABORT})
# Answered only when the request says ``"reply": true``.
OPTIONAL_REPLY_OPS = frozenset({GROUP_BROKEN, GROUP_LEAVE})

# Refusal kinds in replies, and what the consumer raises for each.
LOST = "lost"
UNAUTHENTICATED = "unauthenticated"
BUSY = "busy"
BAD_REQUEST = "bad_request"
TRANSFER = "transfer"


@functools.lru_cache(maxsize=4)
def _proof_for(session: tuple[int, str]) -> str | None:
    token = _ray.cluster_auth_token()
    if token is None:
        return None
    # A digest, not the token: whoever reads our traffic cannot replay it against Ray itself.
    return hmac.new(token, b"raydirect agent v1", hashlib.sha256).hexdigest()


def auth_proof() -> str | None:
    """What every request carries when Ray's token authentication is on (else None)."""
    return _proof_for(_ray.session_key())


CURVE_MARK = "/curve/"  # an encrypted agent's address: tcp://ip:port/curve/<public key, hex>


def split_address(address: str) -> tuple[str, bytes | None]:
    """An agent address's ZeroMQ endpoint and, for an encrypted agent, its CURVE
    public key (Z85). The key travels inside the address, so wherever an address
    goes (the ObjectRef's payload, over Ray's own TLS-protected channels; the
    status announcement; group membership) the key needed to reach it goes too."""
    endpoint, mark, key_hex = address.partition(CURVE_MARK)
    if not mark:
        return address, None
    try:
        return endpoint, zmq.utils.z85.encode(bytes.fromhex(key_hex))
    except ValueError as exc:
        raise TransferError(f"malformed agent address {address!r}: {exc}") from exc


def encrypted_address(endpoint: str, public_key: bytes) -> str:
    return f"{endpoint}{CURVE_MARK}{zmq.utils.z85.decode(public_key).hex()}"


def auth_fragment() -> bytes | None:
    """The bytes every authenticated request contains (``encode_header`` writes the
    proof as ``"auth": "<digest>"``): the agent drops what lacks them unparsed."""
    proof = auth_proof()
    return None if proof is None else b'"auth": "' + proof.encode() + b'"'


def authenticated(request: Any) -> bool:
    """Does ``request`` carry this cluster's proof (or is none required)?"""
    expected = auth_proof()
    if expected is None:
        return True
    got = request.get("auth") if isinstance(request, dict) else None
    return isinstance(got, str) and hmac.compare_digest(got.encode(), expected.encode())


def wants_reply(request: Any) -> bool:
    op = request.get("op") if isinstance(request, dict) else None
    if op in NOTIFY_OPS:
        return False
    if op in OPTIONAL_REPLY_OPS:
        return bool(request.get("reply"))
    return True


def wants_reply_raw(op: str, data: bytes) -> bool:
    """``wants_reply`` without parsing: for requests refused before they are decoded."""
    if op in NOTIFY_OPS:
        return False
    if op in OPTIONAL_REPLY_OPS:
        return b'"reply": true' in data
    return True


def refusal(kind: str, error: str) -> dict[str, Any]:
    return {"ok": False, "kind": kind, "error": error}


def encode_header(header: dict[str, Any]) -> bytes:
    return json.dumps(header).encode()


def decode_header(data: bytes, who: str) -> dict[str, Any]:
    """A reply's JSON header; ``TransferError`` for anything that is not one."""
    try:
        header = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise TransferError(f"corrupt reply from {who}: {exc}") from exc
    if not isinstance(header, dict):
        raise TransferError(f"corrupt reply from {who}: a {type(header).__name__} header")
    return header


def raise_for_refusal(header: dict[str, Any], who: str) -> None:
    """Map a refused reply to the exception the consumer raises; nothing if ``ok``."""
    if header.get("ok"):
        return
    message = header.get("error", "unknown error")
    kind = header.get("kind")
    if kind == LOST:
        raise ProducerLostError.of(who, f"no longer holds the object ({message})")
    if kind == UNAUTHENTICATED:
        raise TransferError(
            f"the producer {who} refused this process ({message}): run it in the same "
            "Ray cluster, with the cluster's token (RAY_AUTH_TOKEN or ~/.ray/auth_token)"
        )
    if kind == BUSY:
        raise TransferError(
            f"the producer {who} is too busy to take this request ({message}); "
            "read it again, or send fewer requests to it at once"
        )
    raise TransferError(f"the producer {who} could not send the object: {message}")


# ------------------------------------------------- transport metadata, no pickle
#
# Metadata prepared in the background travels from the producer's agent to the
# consumer. Byte transports' metadata is a JSON-able dict; a plug-in's is a
# ``TensorTransportMetadata`` dataclass with shapes, dtypes and bytes in it. The
# codec tags what JSON lacks; a dataclass is rebuilt only as a class already
# loaded in the consumer (the plug-in's own, arrived with its registration), so
# a peer can name no code to run.


def encode_value(value: Any, frames: list[bytes]) -> Any:
    """``value`` as JSON-able data; byte strings go to ``frames``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        frames.append(bytes(value))
        return {"__bytes__": len(frames) - 1}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, np.dtype) and not value.hasobject:
        return {"__npdtype__": value.str}
    if isinstance(value, np.generic):
        return encode_value(value.item(), frames)
    if isinstance(value, np.ndarray) and not value.dtype.hasobject:
        frames.append(np.ascontiguousarray(value).tobytes())
        return {"__ndarray__": len(frames) - 1, "dtype": value.dtype.str, "shape": value.shape}
    if isinstance(value, list):
        return [encode_value(v, frames) for v in value]
    if isinstance(value, tuple):  # torch.Size too
        return {"__tuple__": [encode_value(v, frames) for v in value]}
    if isinstance(value, dict):
        return {
            "__dict__": [
                [encode_value(k, frames), encode_value(v, frames)] for k, v in value.items()
            ]
        }
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        fields = {
            f.name: encode_value(getattr(value, f.name), frames)
            for f in dataclasses.fields(value)
            if f.init
        }
        return {"__dataclass__": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}
    raise TypeError(
        f"transport metadata holds a {type(value).__name__}, which raydirect cannot send "
        "without pickle; use plain values, bytes, tuples, dicts, torch and numpy dtypes, "
        "numpy arrays and dataclasses"
    )


def decode_value(data: Any, frames: list[bytes], classes: dict[str, type]) -> Any:
    """The inverse of ``encode_value``; ``classes`` maps the dataclasses it may build."""
    if isinstance(data, list):
        return [decode_value(v, frames, classes) for v in data]
    if not isinstance(data, dict):
        return data
    if "__bytes__" in data:
        return frames[int(data["__bytes__"])]
    if "__dtype__" in data:
        dtype = getattr(torch, str(data["__dtype__"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {data['__dtype__']!r}")
        return dtype
    if "__npdtype__" in data:
        return np.dtype(str(data["__npdtype__"]))
    if "__ndarray__" in data:
        raw = frames[int(data["__ndarray__"])]
        dtype = np.dtype(str(data["dtype"]))
        if dtype.hasobject:
            raise ValueError("object arrays are refused")
        return np.frombuffer(raw, dtype=dtype).reshape([int(n) for n in data["shape"]]).copy()
    if "__tuple__" in data:
        return tuple(decode_value(v, frames, classes) for v in data["__tuple__"])
    if "__dict__" in data:
        return {
            decode_value(k, frames, classes): decode_value(v, frames, classes)
            for k, v in data["__dict__"]
        }
    if "__dataclass__" in data:
        cls = classes.get(str(data["__dataclass__"]))
        if cls is None:
            raise ValueError(f"metadata of an unknown class {data['__dataclass__']!r}")
        fields = {str(k): decode_value(v, frames, classes) for k, v in data["fields"].items()}
        return cls(**fields)
    raise ValueError("malformed metadata")


def class_key(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"
