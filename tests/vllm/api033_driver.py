"""vLLM 0.33's weight-transfer API against raydirect, run by test_vllm033_api.py
with PYTHONPATH naming the 0.33 API tree (scripts/setup-vllm-venv.sh): its own
Ray, a real engine of the 0.32 build, and 0.33's ``weight_transfer/`` and KV
connector base. Prints one line per check; exits non-zero on the first that fails."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import ray
import torch
import vllm.distributed.weight_transfer.base as wt
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import (
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

import raydirect.vllm
from raydirect.vllm import RaydirectTrainerInitInfo, ShardedModuleSource
from raydirect.vllm.kv_connector import RaydirectConnector
from raydirect.vllm.sources import placement_of


def check(what: str, ok: bool) -> None:
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        sys.exit(1)


def the_api_is_033s() -> None:
    check("0.33's WeightSource is the one imported", hasattr(wt.WeightSource, "iter_local"))
    check(
        "0.33's KV connector base is the one imported",
        hasattr(KVConnectorBase_V1, "restore_kv_caches"),
    )
    check("the weight backend registers", "raydirect" in WeightTransferEngineFactory._registry)
    check("the trainer backend registers", "raydirect" in WeightTransferTrainerFactory._registry)
    check("the KV connector registers", "RaydirectConnector" in KVConnectorFactory._registry)
    check("no weight name is missing", not raydirect.vllm._missing)
    check("KV: no sleep mode", RaydirectConnector.supports_sleep_mode(None) is False)


def sources_meet_033s_checks() -> None:
    model = torch.nn.Linear(4, 3)
    source = ShardedModuleSource(model)
    check(
        "ShardedModuleSource.metadata is a property",
        [m.name for m in source.metadata] == ["weight", "bias"],
    )
    check("... that 0.32 may also call", source.metadata() is source.metadata)
    check(
        "... and iter_local yields the tensors", dict(source.iter_local())["weight"] is model.weight
    )
    check("0.33 says it implements iter_local", source.implements_iter_local())


def placements_cut_as_torch_chunk() -> None:
    """Each rank's piece as placement_of places it equals torch.chunk's cut."""
    whole = torch.arange(7 * 5).reshape(7, 5)
    cases = [
        ((3,), (wt.Shard(0),)),
        ((2, 2), (wt.Replicate(), wt.Shard(1))),
        ((2, 3), (wt.Shard(0), wt.Shard(0))),  # the outer axis first
    ]
    for mesh, placements in cases:
        owners = tuple(range(int(torch.tensor(mesh).prod())))
        meta = wt.ParamMeta(
            "w", whole.dtype, (7, 5), owners=owners, mesh_shape=mesh, placements=placements
        )
        for rank in owners:
            coords = torch.unravel_index(torch.tensor(rank), mesh)
            piece = whole
            for axis, p in enumerate(placements):
                if isinstance(p, wt.Shard):
                    chunks, at = torch.chunk(piece, mesh[axis], dim=p.dim), int(coords[axis])
                    # torch.chunk may make fewer chunks: the last coordinates hold none
                    piece = chunks[at] if at < len(chunks) else piece.narrow(p.dim, 0, 0)
            shape, dim, start = placement_of(meta, rank)
            if piece.numel() == 0:
                check(
                    f"rank {rank} of mesh {mesh} {placements}: none",
                    start == whole.shape[dim] or piece.shape[dim] == 0,
                )
                continue
            got = whole.narrow(dim, start, piece.shape[dim])
            check(
                f"rank {rank} of mesh {mesh} {placements}",
                shape == (7, 5) and torch.equal(got, piece),
            )


def a_trainer_updates_a_real_engine(path: Path) -> None:
    """0.33's factory, vLLM's own ModuleSource: exact values in the engine."""
    from vllm_harness import (
        LOGPROB_TOLERANCE,
        hf_prompt_logprobs,
        max_difference,
        prompt,
        random_llama,
        start_engine,
    )

    engine = start_engine(path, weight_transfer_config={"backend": "raydirect"})
    model = random_llama(seed=33)
    trainer = WeightTransferTrainerFactory.trainer_init(
        RaydirectTrainerInitInfo(rank=0, timeout=120, name="api033"),
        client=RayVLLMWeightSyncClient([engine]),
        source=wt.ModuleSource(model),
    )
    check("the trainer engine is told its rank", trainer.rank == 0)
    ids = prompt(24, 5)
    for step in range(2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        trainer.send_weights()
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        got = ray.get(engine.prompt_logprobs.remote(ids), timeout=120)
        check(
            f"update {step + 1} serves the trainer's weights",
            max_difference(got, hf_prompt_logprobs(state, ids)) < LOGPROB_TOLERANCE,
        )
    check("the engine's version", ray.get(engine.get_weight_version.remote()) == "2")
    fsdp_ranks_publish_their_own(engine)


def fsdp_ranks_publish_their_own(engine: object) -> None:
    """A 2-rank FSDP2 trainer on vLLM 0.33's ModuleSource: each rank publishes
    its own shards (iter_local, placed by the metadata), none gathers."""
    import fsdp_ranks
    from vllm_harness import LOGPROB_TOLERANCE, hf_prompt_logprobs, max_difference, prompt

    ranks = fsdp_ranks.start_ranks(seed=34)
    ray.get([r.trainer_init.remote([engine], sharded=False) for r in ranks], timeout=120)
    ray.get([r.step.remote() for r in ranks], timeout=60)
    before = ray.get([r.bytes_sent.remote() for r in ranks])
    said = ray.get([r.send_weights.remote() for r in ranks], timeout=300)
    check(f"both ranks send {said}", said == ["", ""])
    full = ray.get([r.full_state.remote() for r in ranks])[0]
    ids = prompt(24, 6)
    got = ray.get(engine.prompt_logprobs.remote(ids), timeout=120)
    check(
        "the engine serves the sharded trainer's model",
        max_difference(got, hf_prompt_logprobs(full, ids)) < LOGPROB_TOLERANCE,
    )

    def settle(worker: object) -> bool:
        import raydirect.testing

        return raydirect.testing.wait_read_counts(30)

    ray.get(engine.collective_rpc.remote(settle), timeout=60)
    sent = [
        a - b for a, b in zip(ray.get([r.bytes_sent.remote() for r in ranks]), before, strict=True)
    ]
    shards = ray.get([r.shard_bytes.remote() for r in ranks])
    check(f"each rank sent its own shards, no gather ({sent} == {shards})", sent == shards)


def main() -> None:
    the_api_is_033s()
    sources_meet_033s_checks()
    placements_cut_as_torch_chunk()
    import fsdp_ranks
    import vllm_harness
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(vllm_harness)
    cloudpickle.register_pickle_by_value(fsdp_ranks)
    ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="warning")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            vllm_harness.save_llama(Path(tmp))
            a_trainer_updates_a_real_engine(Path(tmp))
    finally:
        ray.shutdown()
    print("all checks passed", flush=True)


if __name__ == "__main__":
    main()
