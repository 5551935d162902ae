"""What the two sides of a KV hand-off tell each other: plain data, no vLLM calls.

* The prefill engine's workers tell its scheduler their region and layout once
  (``Handshake``, through vLLM's handshake-metadata collection at start).
* A finished prefill's ``kv_transfer_params`` carry vLLM's standard fields
  (``do_remote_prefill``, ``remote_block_ids``, ``remote_request_id``,
  ``remote_engine_id``, ``remote_num_tokens``, ``tp_size``) plus a ``raydirect``
  section: one region handle per tensor-parallel rank, the caches' layout, the
  block size, the lease (its length, and the wall-clock time at which the
  prefill engine frees the blocks unless a decode engine renews it), the
  hand-off's seal and the engine's compatibility fingerprint (``Handoff``). All
  of it JSON, so vLLM's proxies and routers carry it unchanged.
* The prefill engine signs what a decode engine reads by (the standard fields
  and the section) with a key that only the processes of its Ray cluster can
  derive (``rd.cluster_secret``): the params travel through the client, and a
  client that edits a block id, an address or an expiry steers the decode
  engine's read of the prefill engine's memory. An unsigned or altered hand-off
  is a malformed one (``KVParamsError``): prefilled locally, never read.
* The seal: a random secret per hand-off. Its digest sits in a word of the
  prefill worker's region from before the prompt is computed until the blocks
  are freed; a decode worker reads the word after its read (a freed hand-off's
  bytes are a load error, never decoded), and a notice that frees or renews the
  hand-off must carry the secret (a client can free or hold only its own).
* Each step, the scheduler hands its workers the reads to start, the leases to
  hold, the seals to set and the leases to renew (``KVMetadata``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

import raydirect as rd
from raydirect.vllm.kv_layout import LayerRuns, layers_from_dict
from raydirect.vllm.kv_params import (
    BLOCK_ID_MAX,
    INT64_MAX,
    MAX_LEASE_S,
    KVParamsError,
    entry,
    finite,
    items,
    table,
    text,
    whole,
)

SECTION = "raydirect"
# A decode engine starts a read only if it can finish this long before the
# prefill engine's lease ends (clock skew between nodes, the notice's trip).
READ_MARGIN_S = 1.0
# Tensor-parallel ranks a hand-off may name (one region each).
MAX_RANKS = 1024
# Hand-offs a prefill worker seals at once: requests being prefilled for a
# decode engine, and leases held (a word each, 512 KiB per worker). A request
# beyond them is not handed over (its decode engine prefills it).
MAX_SEALS = 1 << 16
SECRET_CHARS = 32  # a seal's secret, hex: 128 bits
KEY_PURPOSE = "vllm-kv-handoff"  # rd.cluster_secret's purpose for the signing key
# What the fingerprint may hold (it comes in the request too).
MAX_FINGERPRINT = 32


@dataclass
class Handshake(KVConnectorHandshakeMetadata):
    """One worker's region (``RegionHandle.to_dict()``), cache layout, engine
    fingerprint and the cluster's signing key (hex; it stays in the engine:
    vLLM hands handshakes from its workers to its scheduler, nowhere else)."""

    region: dict[str, Any]
    layout: dict[str, list[object]]
    fingerprint: dict[str, str]
    key: str


@dataclass(frozen=True)
class Handoff:
    """The ``raydirect`` section of a prefill's ``kv_transfer_params``, parsed."""

    regions: tuple[rd.RegionHandle, ...]
    layout: dict[str, LayerRuns]
    block_size: int
    expires_at: float  # the prefill engine's wall clock: a first estimate only
    lease_s: float  # how long each renewal holds the blocks, on its own clock
    seal_slot: int  # the seal's word in each prefill rank's region
    secret: str  # the seal's secret (hex)
    fingerprint: tuple[tuple[str, str], ...]
    remote_request_id: str
    block_ids: tuple[int, ...]  # the prompt's blocks in the prefill engine, in order
    num_tokens: int  # the prompt tokens they hold

    @classmethod
    def of(cls, params: dict[str, Any], key: bytes | None) -> Handoff:
        """Parsed from ``params``, vLLM's standard fields too, and checked against
        the prefill engine's signature with ``key`` (the cluster's). All of it
        comes from a client, so every value is checked before any arithmetic
        (``kv_params``): ``KVParamsError`` naming the first field that is
        missing or wrong; ``raydirect.mac`` when the values are well formed but
        not the ones the prefill engine signed."""
        section = params.get(SECTION)
        if not isinstance(section, dict):
            raise KVParamsError(
                SECTION,
                "no such section: the params come from another connector than RaydirectConnector",
            )
        where = f"{SECTION}."
        block_size = whole(
            entry(section, "block_size", where), f"{where}block_size", 1, BLOCK_ID_MAX
        )
        num_tokens = whole(entry(params, "remote_num_tokens"), "remote_num_tokens", 1, BLOCK_ID_MAX)
        blocks = -(-num_tokens // block_size)  # what the prefill engine hands over
        slot, secret = items(entry(section, "seal", where), f"{where}seal", 2, 2)
        handoff = cls(
            regions=_regions(entry(section, "regions", where)),
            layout=layers_from_dict(entry(section, "layout", where), f"{where}layout"),
            block_size=block_size,
            expires_at=_expiry(entry(section, "expires_at", where)),
            lease_s=lease_seconds(entry(section, "lease_s", where), f"{where}lease_s"),
            seal_slot=whole(slot, f"{where}seal[0]", high=MAX_SEALS - 1),
            secret=_secret(secret),
            fingerprint=_fingerprint(entry(section, "fingerprint", where)),
            remote_request_id=text(entry(params, "remote_request_id"), "remote_request_id"),
            block_ids=tuple(
                whole(b, f"remote_block_ids[{i}]", high=BLOCK_ID_MAX)
                for i, b in enumerate(
                    items(entry(params, "remote_block_ids"), "remote_block_ids", blocks, blocks)
                )
            ),
            num_tokens=num_tokens,
        )
        handoff._check_layout()
        _check_signature(params, key)
        return handoff

    def _check_layout(self) -> None:
        """Every layer's runs lie in a tensor each region has (the seal words'
        tensor, the last, excepted), and its last block's end fits the int64
        rows (numpy would wrap around, silently)."""
        tensors = min(len(r.nbytes) for r in self.regions) - 1
        last = max(self.block_ids)
        for name, runs in self.layout.items():
            field = f"{SECTION}.layout[{name!r}]"
            if runs.tensor >= tensors:
                raise KVParamsError(f"{field}[0]", f"no tensor {runs.tensor} in the regions")
            if runs.end(last) > INT64_MAX:
                raise KVParamsError(field, f"block {last} ends beyond 2**63 bytes")

    def seconds_left(self, renewed: float | None = None) -> float:
        """Seconds a read may still take (its deadline, before the lease ends):
        by the prefill engine's expiry on this engine's wall clock, or, later,
        by this engine's last renewal that reached it (``renewed``, monotonic:
        the lease then ends no sooner than ``lease_s`` after it)."""
        left = self.expires_at - time.time()
        if renewed is not None:
            left = max(left, renewed + self.lease_s - time.monotonic())
        return left - READ_MARGIN_S

    @property
    def seal_word(self) -> int:
        return seal_word(self.secret)


def seal_word(secret: str) -> int:
    """What a prefill worker's seal word holds while the hand-off of ``secret``
    may be read: a digest (never the secret, which frees the blocks), an int64,
    never zero."""
    digest = hashlib.blake2b(secret.encode(), digest_size=8, person=b"raydirect-kv").digest()
    return int.from_bytes(digest, "little", signed=True) or 1


def signing_key(hex_key: str) -> bytes:
    return bytes.fromhex(hex_key)


def _signed(params: dict[str, Any]) -> bytes:
    """What the prefill engine signs: every value a decode engine reads by, as
    canonical JSON (a proxy that re-encodes the JSON changes no value)."""
    section = {k: v for k, v in params[SECTION].items() if k != "mac"}
    body = {k: params.get(k) for k in _SIGNED_FIELDS}
    body[SECTION] = section
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


_SIGNED_FIELDS = ("remote_block_ids", "remote_request_id", "remote_engine_id", "remote_num_tokens")


def _mac(params: dict[str, Any], key: bytes) -> str:
    return hmac.new(key, _signed(params), hashlib.sha256).hexdigest()


def _check_signature(params: dict[str, Any], key: bytes | None) -> None:
    mac = params[SECTION].get("mac")
    if not isinstance(mac, str):
        raise KVParamsError(f"{SECTION}.mac", "missing: the params are not signed")
    if key is None:
        raise KVParamsError(f"{SECTION}.mac", "this engine has no signing key yet")
    if not hmac.compare_digest(mac, _mac(params, key)):
        raise KVParamsError(
            f"{SECTION}.mac",
            "does not match: the params were altered after the prefill engine signed "
            "them, or come from an engine of another Ray cluster",
        )


def _regions(value: Any) -> tuple[rd.RegionHandle, ...]:
    """One region handle per prefill rank, each checked as a handle."""
    handles = []
    for i, region in enumerate(items(value, f"{SECTION}.regions", 1, MAX_RANKS)):
        try:
            handles.append(rd.RegionHandle.from_dict(region))
        except ValueError as exc:
            raise KVParamsError(f"{SECTION}.regions[{i}]", str(exc)[:200]) from None
    return tuple(handles)


def _expiry(value: Any) -> float:
    """The lease's end, at most the longest lease ahead (``MAX_LEASE_S``, and the
    clocks' margin): an expiry a prefill engine cannot have set (``1e999``: a read
    with no deadline, a claim kept for ever) is refused, never clamped."""
    expires_at = finite(value, f"{SECTION}.expires_at")
    ahead = expires_at - time.time()
    if ahead > MAX_LEASE_S + READ_MARGIN_S:
        raise KVParamsError(
            f"{SECTION}.expires_at",
            f"ends {ahead:.3g}s from now, beyond the longest lease ({MAX_LEASE_S:g}s)",
        )
    return expires_at


def lease_seconds(value: Any, name: str) -> float:
    """A lease's length: above the read margin (a shorter one ends before any
    decode engine may read) and at most ``MAX_LEASE_S``; NaN and infinities
    refused (one would never end). The prefill engine's setting and the length a
    hand-off carries are both checked here."""
    lease_s = finite(value, name)
    if not READ_MARGIN_S < lease_s <= MAX_LEASE_S:
        raise KVParamsError(name, f"{lease_s:g} is not in ({READ_MARGIN_S}, {MAX_LEASE_S:g}]")
    return lease_s


def _secret(value: Any) -> str:
    secret = text(value, f"{SECTION}.seal[1]", SECRET_CHARS)
    try:
        if len(bytes.fromhex(secret)) * 2 == SECRET_CHARS:
            return secret
    except ValueError:
        pass
    raise KVParamsError(f"{SECTION}.seal[1]", f"not {SECRET_CHARS} hex digits")


def _fingerprint(value: Any) -> tuple[tuple[str, str], ...]:
    name = f"{SECTION}.fingerprint"
    fields = table(value, name, MAX_FINGERPRINT)
    return tuple(
        (text(k, f"{name} key"), text(v, f"{name}[{k!r}]")) for k, v in sorted(fields.items())
    )


def handoff_params(
    *,
    request_id: str,
    engine_id: str,
    block_ids: list[int],
    num_tokens: int,
    handshakes: list[Handshake],
    block_size: int,
    expires_at: float,
    lease_s: float,
    seal: tuple[int, str],
) -> dict[str, Any]:
    """The ``kv_transfer_params`` a finished prefill returns (JSON-safe), signed
    with the key of its workers' handshakes."""
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": list(block_ids),
        "remote_request_id": request_id,
        "remote_engine_id": engine_id,
        "remote_num_tokens": num_tokens,
        "tp_size": len(handshakes),
        SECTION: {
            "regions": [h.region for h in handshakes],
            "layout": handshakes[0].layout,
            "block_size": block_size,
            "expires_at": expires_at,
            "lease_s": lease_s,
            "seal": list(seal),
            "fingerprint": handshakes[0].fingerprint,
        },
    }
    section = params[SECTION]
    section["mac"] = _mac(params, signing_key(handshakes[0].key))
    return params


@dataclass
class Read:
    """One request's read on the decode side: ``remote`` blocks of the prefill
    engine into ``local`` ones (both empty: only tell it to free them).
    ``awaiting``: the scheduler waits for this read (report it finished).
    ``seconds``: how long the read may take, from when the step began."""

    request_id: str
    local: list[int]
    remote: list[int]
    handoff: Handoff
    awaiting: bool
    error: str | None = None  # why it cannot be read: its blocks are load errors
    seconds: float = 0.0


@dataclass(frozen=True)
class Lease:
    """A finished prefill's blocks, held for a reader: ``seconds`` from the step
    (then as long again from each renewal), its seal's slot and word."""

    seconds: float
    slot: int
    word: int


@dataclass
class KVMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step. Prefill side: seals to set (request
    -> slot and word; word 0 clears it) and leases to hold. Decode side: reads
    to start, and the hand-offs whose leases to renew."""

    reads: list[Read] = field(default_factory=list)
    leases: dict[str, Lease] = field(default_factory=dict)
    seals: dict[str, tuple[int, int]] = field(default_factory=dict)
    renewals: list[Handoff] = field(default_factory=list)
