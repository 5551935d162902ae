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

from raydirect.vllm.kv_layout import LayerRuns, layers_from_dict

SECTION = "raydirect"
# A decode engine starts a read only if it can finish this long before the
# prefill engine's lease ends (clock skew between nodes, the notice's trip).
READ_MARGIN_S = 1.0


@dataclass
class Handshake(KVConnectorHandshakeMetadata):
    """One worker's region (``RegionHandle.to_dict()``) and cache layout."""

    region: dict[str, Any]
    layout: dict[str, list[object]]


@dataclass(frozen=True)
class Handoff:
    """The ``raydirect`` section of a prefill's ``kv_transfer_params``, parsed."""

    regions: tuple[dict[str, Any], ...]
    layout: dict[str, LayerRuns]
    block_size: int
    expires_at: float
    remote_request_id: str
    block_ids: tuple[int, ...]  # the prompt's blocks in the prefill engine, in order
    num_tokens: int  # the prompt tokens they hold

    @classmethod
    def of(cls, params: dict[str, Any]) -> Handoff:
        """Parsed from ``params``, vLLM's standard fields too (they come from a
        client: a bad one must not reach the scheduler's arithmetic); ``ValueError``
        naming what is missing or wrong."""
        section = params.get(SECTION)
        if not isinstance(section, dict):
            raise ValueError(
                f"kv_transfer_params carry no {SECTION!r} section: they come from another "
                "connector than RaydirectConnector"
            )
        try:
            regions = tuple(dict(r) for r in section["regions"])
            handoff = cls(
                regions=regions,
                layout=layers_from_dict(section["layout"]),
                block_size=_count(section["block_size"], "block_size"),
                expires_at=float(section["expires_at"]),
                remote_request_id=str(params["remote_request_id"]),
                block_ids=tuple(_count(b, "remote_block_ids") for b in params["remote_block_ids"]),
                num_tokens=_count(params["remote_num_tokens"], "remote_num_tokens"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed kv_transfer_params: {exc!r}") from None
        if handoff.block_size == 0 or len(handoff.block_ids) * handoff.block_size < (
            handoff.num_tokens
        ):
            raise ValueError(
                f"malformed kv_transfer_params: {len(handoff.block_ids)} blocks of "
                f"{handoff.block_size} tokens cannot hold remote_num_tokens={handoff.num_tokens}"
            )
        return handoff

    def seconds_left(self) -> float:
        """Seconds a read may still take (its deadline, before the lease ends)."""
        return self.expires_at - READ_MARGIN_S - time.time()


def _count(value: Any, name: str) -> int:
    """A JSON integer >= 0 (a bool or a string is refused)."""
    if type(value) is not int or value < 0:
        raise ValueError(f"{name}: {value!r} is not an integer >= 0")
    return value


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
