"""``rd.cluster_secret``: a key every process of one Ray cluster derives alike.

What a handle or its companions travel with outside Ray (a region's handle
inside an HTTP request's JSON, vLLM's ``kv_transfer_params``) can be forged by
whoever writes that request. A process that signs what it sends with a key of
the cluster's lets the reader tell its own cluster's word from a client's: the
vLLM KV connector signs a prefill engine's hand-off with
``cluster_secret("vllm-kv-handoff")``.

The root is Ray's auth token where token authentication is on (every process
of the cluster has it, nothing outside does); elsewhere a random key, made by
the first process that asks and kept in the cluster's GCS, whose readers are
whoever can connect to the cluster. Each purpose gets its own HMAC of the
root, so one purpose's secret tells nothing of another's, nor of the token.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading

from raydirect import _ray
from raydirect._payload import check_usable_here

_LABEL = b"raydirect secret v1 "  # bumped if the derivation changes
_KEY_BYTES = 32

_lock = threading.Lock()
_roots: dict[tuple[int, str], bytes] = {}  # by Ray session (and pid: a fork asks again)


def cluster_secret(purpose: str) -> bytes:
    """32 bytes that every process of this Ray cluster derives alike for
    ``purpose`` (a short name of what they sign, such as ``"vllm-kv-handoff"``)
    and no process outside it can: sign what travels outside Ray (a region's
    handle in an HTTP request) so that a reader tells its own cluster's from a
    forgery (``hmac.new(rd.cluster_secret("my-app"), message, "sha256")``).
    Different purposes give unrelated secrets.

    With Ray's token authentication on (``RAY_AUTH_MODE=token``), it is an
    HMAC-SHA256 of the cluster's token; otherwise of a random key that the
    first process asking stores in the cluster's GCS, readable by whatever can
    connect to the cluster. Connects to Ray like ``rd.put`` when this process
    is not connected yet; later calls in one Ray session cost no Ray call.

    Raises ``TypeError`` when ``purpose`` is not a str, ``ValueError`` when it
    is empty, ``rd.RaydirectError`` in a process forked from one connected to
    Ray, and what Ray raises when its GCS cannot be reached."""
    if not isinstance(purpose, str):
        raise TypeError(
            f"purpose must be a str naming what is signed, got {type(purpose).__name__}"
        )
    if not purpose:
        raise ValueError("purpose must be a non-empty str naming what is signed")
    check_usable_here()
    _ray.ensure_ray()
    return hmac.new(_root(), _LABEL + purpose.encode(), hashlib.sha256).digest()


def _root() -> bytes:
    """This session's root key: Ray's token, or the cluster's random key."""
    session = _ray.session_key()
    with _lock:
        root = _roots.get(session)
    if root is not None:
        return root
    root = _ray.cluster_auth_token() or _ray.cluster_random_key(os.urandom(_KEY_BYTES))
    with _lock:
        _roots.clear()  # another session's root is of no use any more
        _roots[session] = root
    return root
