"""What the two sides of a KV hand-off tell each other: plain data, no vLLM calls.

* The prefill engine's workers tell its scheduler their region and layout once
  (``Handshake``, through vLLM's handshake-metadata collection at start).
* A finished prefill's ``kv_transfer_params`` carry vLLM's standard fields
  (``do_remote_prefill``, ``remote_block_ids``, ``remote_request_id``,
  ``remote_engine_id``, ``remote_num_tokens``, ``tp_size``) plus a ``raydirect``
  section: one region handle per tensor-parallel rank, the caches' layout, the
  block size and the wall-clock time at which the prefill engine frees the
  blocks (``Handoff``). All of it JSON, so vLLM's proxies and routers carry it
  unchanged.
* Each step, the scheduler hands its workers the reads to start and the leases
  to hold (``KVMetadata``).
"""

from __future__ import annotations

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
    text,
    whole,
)

SECTION = "raydirect"
# A decode engine starts a read only if it can finish this long before the
# prefill engine's lease ends (clock skew between nodes, the notice's trip).
READ_MARGIN_S = 1.0
# Tensor-parallel ranks a hand-off may name (one region each).
MAX_RANKS = 1024


@dataclass
class Handshake(KVConnectorHandshakeMetadata):
    """One worker's region (``RegionHandle.to_dict()``) and cache layout."""

    region: dict[str, Any]
    layout: dict[str, list[object]]


@dataclass(frozen=True)
class Handoff:
    """The ``raydirect`` section of a prefill's ``kv_transfer_params``, parsed."""

    regions: tuple[rd.RegionHandle, ...]
    layout: dict[str, LayerRuns]
    block_size: int
    expires_at: float
    remote_request_id: str
    block_ids: tuple[int, ...]  # the prompt's blocks in the prefill engine, in order
    num_tokens: int  # the prompt tokens they hold

    @classmethod
    def of(cls, params: dict[str, Any]) -> Handoff:
        """Parsed from ``params``, vLLM's standard fields too. All of it comes from
        a client, so every value is checked before any arithmetic (``kv_params``):
        ``KVParamsError`` naming the first field that is missing or wrong."""
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
        handoff = cls(
            regions=_regions(entry(section, "regions", where)),
            layout=layers_from_dict(entry(section, "layout", where), f"{where}layout"),
            block_size=block_size,
            expires_at=_expiry(entry(section, "expires_at", where)),
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
        return handoff

    def _check_layout(self) -> None:
        """Every layer's runs lie in a tensor each region has, and its last block's
        end fits the int64 rows (numpy would wrap around, silently)."""
        tensors = min(len(r.nbytes) for r in self.regions)
        last = max(self.block_ids)
        for name, runs in self.layout.items():
            field = f"{SECTION}.layout[{name!r}]"
            if runs.tensor >= tensors:
                raise KVParamsError(f"{field}[0]", f"no tensor {runs.tensor} in the regions")
            if runs.end(last) > INT64_MAX:
                raise KVParamsError(field, f"block {last} ends beyond 2**63 bytes")

    def seconds_left(self) -> float:
        """Seconds a read may still take (its deadline, before the lease ends)."""
        return self.expires_at - READ_MARGIN_S - time.time()


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


def handoff_params(
    *,
    request_id: str,
    engine_id: str,
    block_ids: list[int],
    num_tokens: int,
    handshakes: list[Handshake],
    block_size: int,
    expires_at: float,
) -> dict[str, Any]:
    """The ``kv_transfer_params`` a finished prefill returns (JSON-safe)."""
    return {
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
        },
    }


@dataclass
class Read:
    """One request's read on the decode side: ``remote`` blocks of the prefill
    engine into ``local`` ones (both empty: only tell it to free them).
    ``awaiting``: the scheduler waits for this read (report it finished)."""

    request_id: str
    local: list[int]
    remote: list[int]
    handoff: Handoff
    awaiting: bool
    error: str | None = None  # why it cannot be read: its blocks are load errors


@dataclass
class KVMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step: reads to start (decode side) and
    leases to hold, request -> wall-clock expiry (prefill side)."""

    reads: list[Read] = field(default_factory=list)
    leases: dict[str, float] = field(default_factory=dict)
