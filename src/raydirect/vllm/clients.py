"""Each engine's own weight version after an update, through vLLM's clients.

vLLM's clients set the weight version on every engine they drive once every
``finish_weight_update`` returned, and on none once one raised. A worker of this
backend never raises from its finish (vLLM's worker would keep its session
open): a load that failed is reported through the mailbox. So rank 0 finishes
without a version and then sets it on each engine whose workers all loaded,
where the client lets it tell the engines apart:

- vLLM's Ray client: each engine is one of its handles. Its update is sent
  handle by handle with the handle's index (``engine_index``), which each
  worker reports when it joins, so a report names its handle;
- vLLM's HTTP client: one engine, set through its ``update_weight_version`` route.

Any other client finishes with the version, as vLLM's own backends do.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import ray
import requests
from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest
from vllm.distributed.weight_transfer.clients import (
    HTTPVLLMWeightSyncClient,
    RayVLLMWeightSyncClient,
)


def _fans_out(client: Any) -> bool:
    """vLLM's Ray client as vLLM wrote it: a subclass that sends updates its own
    way is left to do so (its engines' versions are then its finish's)."""
    return (
        isinstance(client, RayVLLMWeightSyncClient)
        and type(client).update_weights is RayVLLMWeightSyncClient.update_weights
    )


def engines_of(client: Any) -> int | None:
    """How many engines rank 0 sets versions on one by one; None: the client's
    own finish sets them."""
    if _fans_out(client):
        return len(client.handles)
    if isinstance(client, HTTPVLLMWeightSyncClient):
        return 1
    return None


def update_each(client: Any, update: dict[str, Any]) -> None:
    """``client.update_weights(update)``, with each Ray handle's index in its copy."""
    if not _fans_out(client):
        client.update_weights({**update, "engine_index": 0})
        return
    ray.get(
        [
            h.update_weights.remote(
                WeightTransferUpdateRequest(update_info={**update, "engine_index": i})
            )
            for i, h in enumerate(client.handles)
        ]
    )


def held_by_index(reports: dict[str, Any], engines: int) -> list[bool]:
    """Which engines (by index) loaded the version: every worker of theirs that
    joined reported its load, without an error."""
    loads: dict[int, list[bool]] = defaultdict(list)
    for worker, who in reports["workers"].items():
        loads[int(who.get("index", -1))].append(reports["said"].get(worker) == "")
    return [bool(loads[i]) and all(loads[i]) for i in range(engines)]


def set_versions(client: Any, held: list[bool], version: str, timeout: float) -> None:
    """The weight version on the engines that loaded it."""
    if isinstance(client, HTTPVLLMWeightSyncClient):  # the route vLLM's server has
        if held[0]:
            url = f"{client.base_url}/update_weight_version"
            requests.post(url, json={"new_version": version}, timeout=timeout).raise_for_status()
        return
    handles = [h for h, loaded in zip(client.handles, held, strict=True) if loaded]
    ray.get([h.update_weight_version.remote(version) for h in handles], timeout=timeout)
