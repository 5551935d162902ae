"""Region scenarios for the multi-node tests; run inside the head's namespace.

    python mn_region_driver.py ADDRESS regions

An owner on node B exports a paged cache as a region; readers on node A (an
actor and the driver) read blocks of it from the handle alone, carried as JSON.
Reports as mn_driver does (``@@RD {...}`` lines). The actor classes live here
(``__main__``), so Ray ships them to workers by value.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import ray
import torch
from mn_driver import GET_TIMEOUT_S, attempt, delta, describe, on, received, run

import raydirect as rd

LAYERS, BLOCKS, BLOCK_ELEMS = 2, 256, 2048  # float32: 8 KiB blocks, a 4 MiB region
BLOCK = BLOCK_ELEMS * 4
READ_BLOCKS = [3, 4, 5, 100, 7, 255, 0]  # touching runs, gaps, out of order
ENCRYPT = {"RAYDIRECT_ENCRYPT": "1"}


def layer_value(layer: int, fill: float | None = None) -> torch.Tensor:
    if fill is not None:
        return torch.full((BLOCKS, BLOCK_ELEMS), fill)
    return (torch.arange(BLOCKS * BLOCK_ELEMS, dtype=torch.float32) + 1e6 * layer).view(
        BLOCKS, BLOCK_ELEMS
    )


def rows_for(blocks: list[int]) -> list[tuple[int, int, int, int, int]]:
    """Block ``b`` of every layer into block ``k`` (its position) of destination ``layer``."""
    return [
        (layer, b * BLOCK, BLOCK, layer, k * BLOCK)
        for layer in range(LAYERS)
        for k, b in enumerate(blocks)
    ]


def read_here(handle: Any, transport: str | None, notify: Any, fill: float | None) -> dict:
    """Read READ_BLOCKS of every layer; what differs, and the transports counted."""
    dests = [torch.zeros(len(READ_BLOCKS), BLOCK_ELEMS) for _ in range(LAYERS)]
    before = received()
    try:
        rd.read_ranges(
            handle,
            rows_for(READ_BLOCKS),
            into=dests,
            timeout=GET_TIMEOUT_S,
            tensor_transport=transport,
            notify=notify,
        )
    except Exception as exc:
        untouched = all(bool((d == 0).all()) for d in dests)
        return {"error": describe(exc), "untouched": untouched}
    wrong = [
        layer
        for layer, d in enumerate(dests)
        if not torch.equal(d, layer_value(layer, fill)[READ_BLOCKS])
    ]
    return {"wrong_layers": wrong, "received": delta(received(), before)}


@ray.remote(num_cpus=0, max_concurrency=2)
class Owner:
    def __init__(self) -> None:
        self.kv = [layer_value(layer) for layer in range(LAYERS)]
        self.region = rd.export_region(self.kv, name="kv")

    def handle(self) -> dict:
        return self.region.handle().to_dict()  # as it travels in an HTTP request's JSON

    def info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "ip": ray.util.get_node_ip_address(),
            "encryption": rd.local_stats().encryption,
        }

    def fill(self, value: float) -> None:
        for t in self.kv:
            t.fill_(value)

    def notices(self, timeout: float) -> list:
        return self.region.notices(timeout)

    def sent(self) -> dict[str, int]:
        return dict(rd.local_stats().bytes_sent)

    def close(self) -> None:
        self.region.close()


@ray.remote(num_cpus=0)
class Reader:
    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "ip": ray.util.get_node_ip_address()}

    def read(
        self, handle: Any, transport: str | None = None, notify: Any = None, fill=None
    ) -> dict:
        return read_here(handle, transport, notify, fill)


def _reads(results: dict[str, Any], owner: Any, handle: dict) -> None:
    """Node A reads node B's region: an actor and the driver, auto and forced."""
    far = Reader.options(**on("nodeA")).remote()
    near = Reader.options(**on("nodeB")).remote()
    results["reader"] = ray.get(far.info.remote(), timeout=GET_TIMEOUT_S)
    for name, transport in (("auto", None), ("tcp", "tcp"), ("cma", "cma")):
        attempt(results, f"{name}/actor", lambda t=transport: ray.get(far.read.remote(handle, t)))
    attempt(results, "auto/driver", lambda: read_here(handle, None, None, None))
    attempt(results, "auto/same_node", lambda: ray.get(near.read.remote(handle)))
    ray.get(owner.fill.remote(5.0), timeout=GET_TIMEOUT_S)
    attempt(results, "after_write", lambda: ray.get(far.read.remote(handle, None, None, 5.0)))
    notice = {"request": "r-1", "blocks": READ_BLOCKS}
    attempt(results, "notify", lambda: ray.get(far.read.remote(handle, None, notice, 5.0)))
    results["heard"] = ray.get(owner.notices.remote(30.0), timeout=GET_TIMEOUT_S)
    results["owner_sent"] = ray.get(owner.sent.remote(), timeout=GET_TIMEOUT_S)
    ray.get(owner.close.remote(), timeout=GET_TIMEOUT_S)
    attempt(results, "after_close", lambda: ray.get(far.read.remote(handle)))
    for actor in (far, near):
        ray.kill(actor)


def _encrypted(results: dict[str, Any]) -> None:
    """An owner whose stream port encrypts (TLS), read from node A by a reader that
    encrypts too; a reader that encrypts refuses a clear owner's bytes."""
    sealed = Owner.options(**on("nodeB"), runtime_env={"env_vars": ENCRYPT}).remote()
    clear = Owner.options(**on("nodeB")).remote()
    strict = Reader.options(**on("nodeA"), runtime_env={"env_vars": ENCRYPT}).remote()
    results["sealed_owner"] = ray.get(sealed.info.remote(), timeout=GET_TIMEOUT_S)
    sealed_handle = ray.get(sealed.handle.remote(), timeout=GET_TIMEOUT_S)
    clear_handle = ray.get(clear.handle.remote(), timeout=GET_TIMEOUT_S)
    attempt(results, "tls/sealed", lambda: ray.get(strict.read.remote(sealed_handle)))
    attempt(results, "tls/clear_refused", lambda: ray.get(strict.read.remote(clear_handle)))
    for actor in (sealed, clear, strict):
        ray.kill(actor)


def _owner_killed(results: dict[str, Any]) -> None:
    owner = Owner.options(**on("nodeB")).remote()
    far = Reader.options(**on("nodeA")).remote()
    handle = ray.get(owner.handle.remote(), timeout=GET_TIMEOUT_S)
    attempt(results, "killed/before", lambda: ray.get(far.read.remote(handle)))
    pid = ray.get(owner.info.remote(), timeout=GET_TIMEOUT_S)["pid"]
    os.kill(pid, 9)  # one pid namespace: the nodes differ by network namespace only
    deadline = time.monotonic() + 60
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    attempt(results, "killed/after", lambda: ray.get(far.read.remote(handle)))
    results["killed/detect_s"] = round(time.monotonic() - t0, 3)
    ray.kill(far)


def scenario_regions(address: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    owner = Owner.options(**on("nodeB")).remote()
    results["owner"] = ray.get(owner.info.remote(), timeout=GET_TIMEOUT_S)
    handle = ray.get(owner.handle.remote(), timeout=GET_TIMEOUT_S)
    _reads(results, owner, handle)
    ray.kill(owner)
    _encrypted(results)
    _owner_killed(results)
    return results


def main() -> None:
    address, scenario = sys.argv[1], sys.argv[2]
    run(address, ("nodeA", "nodeB"), lambda: {"regions": scenario_regions}[scenario](address))


if __name__ == "__main__":
    main()
