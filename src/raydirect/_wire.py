"""The control protocol's vocabulary: ops, message forms, agent addresses, the
cluster's CURVE client keys, and what each refusal means to the consumer.

Every message is one ZeroMQ multipart message: a JSON header, then raw frames
(small tensor bytes inline, or byte strings a header refers to). Nothing on the
channel is ever pickle: an agent is reachable from the network, and a consumer
must not run code a peer sends. Requests name an object (``obj``, hex) and carry
its 128-bit capability (``cap``) from the Payload.

Every agent's ROUTER is CURVE-only: the channel is encrypted, and a peer is
authenticated by its handshake, which cannot be replayed (each connection's
keys are fresh). Where Ray's token authentication is on, clients use the
cluster's key pair (``client_keys``: derived from the token, so every process of
the cluster has it and nobody else does) and the agent admits that key only
(``_server``'s ZAP handler); where it is off, any client key, and the
capability alone decides (as in earlier releases).
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
REGION_NOTICE = "region_notice"  # _regions: a reader's notice to a region's owner
REGION_EXTRACT = "region_extract"  # _regions: a plug-in's metadata for one read of a region
REGION_RELEASE = "region_release"  # _regions: that read ended (and was it open throughout?)
LEASES_FREED = "leases_freed"  # _caller_leases: a caller's tokens went out of scope

# Fire-and-forget: a reply would sit unread in the sender's cached channel and
# be taken as the answer to its next request.
NOTIFY_OPS = frozenset({ABORT})
# Answered only when the request says ``"reply": true`` (read notices: by a
# thread of their own, whose channel carries nothing else).
OPTIONAL_REPLY_OPS = frozenset({SENT, GROUP_BROKEN, GROUP_LEAVE})

# Refusal kinds in replies, and what the consumer raises for each.
LOST = "lost"
UNAUTHENTICATED = "unauthenticated"
BUSY = "busy"
BAD_REQUEST = "bad_request"
TRANSFER = "transfer"


@functools.lru_cache(maxsize=4)
def _keys_for(session: tuple[int, str]) -> tuple[bytes, bytes] | None:
    token = _ray.cluster_auth_token()
    if token is None:
        return None
    # A digest of the token, never the token: the CURVE handshake proves the
    # client holds it without sending it, and it cannot be turned back into the
    # token to use against Ray's own gRPC.
    secret = zmq.utils.z85.encode(hmac.new(token, b"raydirect curve v2", hashlib.sha256).digest())
    return zmq.curve_public(secret), secret


def cluster_keys() -> tuple[bytes, bytes] | None:
    """The cluster's CURVE client key pair (public, secret; Z85) when Ray's token
    authentication is on, else None."""
    return _keys_for(_ray.session_key())


_ephemeral: list[tuple[bytes, bytes]] = []


def client_keys() -> tuple[bytes, bytes]:
    """The key pair this process's channels present: the cluster's, or (token
    authentication off) one made for this process."""
    keys = cluster_keys()
    if keys is not None:
        return keys
    if not _ephemeral:
        _ephemeral.append(zmq.curve_keypair())
    return _ephemeral[0]


CURVE_MARK = "/curve/"  # tcp://ip:port/curve/<the agent's CURVE public key, hex>
TLS_MARK = "/tls/"  # then, when its stream port encrypts: /tls/ca-<sha-256 hex> or /tls/<hex>


@dataclasses.dataclass(frozen=True)
class AgentAddress:
    """An agent address's parts. The address travels inside every ObjectRef's
    payload, over Ray's own TLS-protected channels (and in the status
    announcement and group membership), so the keys needed to reach an agent
    travel with it and nobody can slip a consumer others."""

    endpoint: str  # tcp://ip:port, the ZeroMQ endpoint
    host: str
    curve_key: bytes  # Z85
    tls: str | None  # None: its stream port is in clear; else the pin (``_tls``)


def parse_address(address: str) -> AgentAddress:
    endpoint, mark, rest = address.partition(CURVE_MARK)
    key_hex, tls_mark, pin = rest.partition(TLS_MARK)
    try:
        if not mark:
            raise ValueError("no CURVE key")
        key = zmq.utils.z85.encode(bytes.fromhex(key_hex))
        if len(key) != 40:
            raise ValueError("a CURVE key is 32 bytes")
    except ValueError as exc:
        raise TransferError(f"malformed agent address {address!r}: {exc}") from exc
    host = endpoint.rpartition("//")[2].rpartition(":")[0]
    return AgentAddress(endpoint, host, key, pin if tls_mark else None)


def agent_address(endpoint: str, curve_key: bytes, tls: str | None) -> str:
    address = f"{endpoint}{CURVE_MARK}{zmq.utils.z85.decode(curve_key).hex()}"
    return address if tls is None else f"{address}{TLS_MARK}{tls}"


def wants_reply(request: Any) -> bool:
    op = request.get("op") if isinstance(request, dict) else None
    if not isinstance(op, str):  # not an op at all (a hostile list, say): refused, answered
        return True
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


def unauthenticated_error(who: str) -> TransferError:
    return TransferError(
        f"the producer {who} refused this process: run it in the same Ray cluster, "
        "with the cluster's token (RAY_AUTH_TOKEN or ~/.ray/auth_token, RAY_AUTH_MODE=token)"
    )


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
        raise unauthenticated_error(who)
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
