"""``RaydirectConnector`` across two nodes of the multi-node harness, encrypted;
run inside the head's namespace (tests/vllm/test_kv_multinode.py).

    python mn_kv_driver.py ADDRESS MODEL_DIR

A prefill engine (P) on node B and a decode engine (D) on node A, both with
``RAYDIRECT_ENCRYPT=1``: D reads each prompt's KV from P over ``tcp`` (TLS).
Reports as tests/multinode/mn_driver.py does (``@@RD {...}`` lines): per prompt
D's tokens, a single engine's (P alone), what D's and P's workers counted, and
whether P freed the blocks on D's notice."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import ray
import vllm_harness
from ray import cloudpickle
from vllm_harness import Engine, prompt, save_llama

import raydirect as rd
from raydirect.vllm import kv_worker

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multinode"))
from mn_driver import GET_TIMEOUT_S, delta, on, run  # noqa: E402

cloudpickle.register_pickle_by_value(vllm_harness)  # Ray's workers cannot import tests/

BLOCK = 32
LENGTHS = (45, 100)
NEW_TOKENS = 8
# P's lease: longer than the run, so blocks freed during it were freed on D's notice
LEASE_S = 120.0
ENCRYPT = {"RAYDIRECT_ENCRYPT": "1"}
FREE_TIMEOUT_S = 20.0


def _engine(model: str, node: str, core: str) -> Any:
    """An engine with the connector on ``node``; its processes encrypt."""
    config = {"kv_connector": "RaydirectConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"kv_lease_duration": LEASE_S}}  # fmt: skip
    return Engine.options(**on(node), runtime_env={"env_vars": ENCRYPT}).remote(  # type: ignore[attr-defined]
        model,
        env={"VLLM_CPU_OMP_THREADS_BIND": core},
        kv_transfer_config=config,
        block_size=BLOCK,
    )


def _worker(_worker: Any) -> dict[str, Any]:
    """Runs in each of an engine's workers: its node, raydirect's counters there,
    its connector's state."""
    return {
        "ip": ray.util.get_node_ip_address(),
        "stats": dataclasses.asdict(rd.local_stats()),
        "connector": kv_worker.status(),
    }


def _state(engine: Any) -> dict[str, Any]:
    [worker] = ray.get(engine.collective_rpc.remote(_worker), timeout=GET_TIMEOUT_S)
    return worker


def _freed(p: Any, request: str) -> bool:
    leases = _state(p)["connector"][0]["leases"]
    return request not in leases and bool(ray.get(p.all_blocks_free.remote(), timeout=60))


def _handoff(p: Any, d: Any, length: int) -> dict[str, Any]:
    """One prompt from P to D; what each side saw."""
    ids = prompt(length, seed=1000 + length)
    _, params, _ = ray.get(
        p.generate_kv.remote(ids, 1, {"do_remote_decode": True}), timeout=GET_TIMEOUT_S
    )
    params = json.loads(json.dumps(params))  # as a proxy forwards them
    before = _state(d)["stats"]
    tokens, _, reason = ray.get(
        d.generate_kv.remote(ids, NEW_TOKENS, params), timeout=GET_TIMEOUT_S
    )
    after = _state(d)
    request = params["remote_request_id"]
    deadline = time.monotonic() + FREE_TIMEOUT_S
    while not _freed(p, request) and time.monotonic() < deadline:
        time.sleep(0.1)  # polling P's pool, with a deadline
    alone, _, _ = ray.get(p.generate_kv.remote(ids, NEW_TOKENS), timeout=GET_TIMEOUT_S)
    return {
        "blocks": len(params["remote_block_ids"]),
        "tokens": tokens,
        "reason": reason,
        "alone": alone,
        "objects": delta(after["stats"]["objects_received"], before["objects_received"]),
        "bytes": delta(after["stats"]["bytes_received"], before["bytes_received"]),
        "reads": [r for r in after["connector"][0]["reads"] if r["remote"] == request],
        "freed": _freed(p, request),
        "freed_before_lease": time.time() < params["raydirect"]["expires_at"] - 2.0,
    }


def scenario(model: str) -> dict[str, Any]:
    save_llama(Path(model))
    p, d = _engine(model, "nodeB", "0"), _engine(model, "nodeA", "1")
    try:
        ray.get([p.__ray_ready__.remote(), d.__ray_ready__.remote()], timeout=300)
        results: dict[str, Any] = {str(n): _handoff(p, d, n) for n in LENGTHS}
        for name, engine in (("p", p), ("d", d)):
            state = _state(engine)
            results[name] = {"ip": state["ip"], "encryption": state["stats"]["encryption"],
                             "sent": state["stats"]["bytes_sent"]}  # fmt: skip
        return results
    finally:
        for engine in (p, d):  # each engine core stopped, or its processes are orphaned
            with contextlib.suppress(Exception):
                ray.get(engine.shutdown.remote(), timeout=60)
            ray.kill(engine)


def main() -> None:
    address, model = sys.argv[1], sys.argv[2]
    run(address, ("nodeA", "nodeB"), lambda: scenario(model))


if __name__ == "__main__":
    main()
