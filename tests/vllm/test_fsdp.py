"""A 2-rank FSDP2 trainer on gloo updating a real engine: with
``ShardedModuleSource`` or vLLM's ``ModuleSource`` each rank sends only its own
shards (no gather), and a rank that dies in the middle of an update is named to
the caller while the engine keeps serving."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import fsdp_ranks
import pytest
import ray
import torch
from fsdp_ranks import start_ranks
from ray import cloudpickle
from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm_harness import (
    LOGPROB_TOLERANCE,
    hf_prompt_logprobs,
    max_difference,
    prompt,
    start_engine,
)

from raydirect.vllm import RaydirectTrainerInitInfo

cloudpickle.register_pickle_by_value(fsdp_ranks)
IDS = prompt(24, 4)


def _serves(engine: Any, state: dict[str, torch.Tensor]) -> float:
    got = ray.get(engine.prompt_logprobs.remote(IDS), timeout=120)
    return max_difference(got, hf_prompt_logprobs(state, IDS))


def _settled(engine: Any) -> None:
    """The engine's workers' reads counted at the ranks (raydirect.testing)."""

    def settle(worker: Any) -> bool:
        import raydirect.testing

        return raydirect.testing.wait_read_counts(30)

    assert all(ray.get(engine.collective_rpc.remote(settle), timeout=60))


def _step_and_sync(engine: Any, ranks: list[Any]) -> tuple[dict[str, torch.Tensor], list[int]]:
    """A step on every rank, then an update: the engine serves the trainer's whole
    model after it; returns that model and the bytes each rank sent for it."""
    ray.get([r.step.remote() for r in ranks], timeout=60)
    before = ray.get([r.bytes_sent.remote() for r in ranks])
    assert ray.get([r.send_weights.remote() for r in ranks], timeout=300) == ["", ""]
    full = ray.get([r.full_state.remote() for r in ranks])[0]
    assert _serves(engine, full) < LOGPROB_TOLERANCE
    _settled(engine)
    after = ray.get([r.bytes_sent.remote() for r in ranks])
    return full, [a - b for a, b in zip(after, before, strict=True)]


@pytest.fixture(scope="module")
def ranks(ray_session: None) -> Any:
    actors = start_ranks()
    yield actors
    for a in actors:
        ray.kill(a)


def test_each_rank_sends_only_its_shards(engine: Any, ranks: list[Any]) -> None:
    ray.get([r.trainer_init.remote([engine], sharded=True) for r in ranks], timeout=120)
    for _ in range(2):
        full, sent = _step_and_sync(engine, ranks)
        shards = ray.get([r.shard_bytes.remote() for r in ranks])
        whole = sum(t.numel() * t.element_size() for t in full.values())
        assert sent == shards, (sent, shards)  # each byte once, from its holder
        assert max(sent) < 0.6 * whole


def test_module_source_over_dtensors_sends_each_rank_its_shards(
    engine: Any, ranks: list[Any]
) -> None:
    """vLLM 0.32's ModuleSource gathers every parameter onto every rank
    (``full_tensor()``): rank 0 held and sent the whole model. The backend reads
    it as ShardedModuleSource: each rank sends its own shards, no rank gathers."""
    ray.get([r.trainer_init.remote([engine], sharded=False) for r in ranks], timeout=120)
    for _ in range(2):
        _full, sent = _step_and_sync(engine, ranks)
        assert sent == ray.get([r.shard_bytes.remote() for r in ranks]), sent


def test_rank0_that_cannot_publish_fails_every_rank_at_once(engine: Any, ranks: list[Any]) -> None:
    """Rank 1 learns of rank 0's failure from the mailbox at once, not when its
    own timeout (300 s here) runs out."""
    ray.get([r.trainer_init.remote([engine], sharded=True, timeout=300) for r in ranks])
    ray.get(ranks[0].break_source.remote())
    errors = ray.get([r.send_weights.remote() for r in ranks], timeout=120)
    assert all("trainer rank 0 could not publish" in e for e in errors), errors
    assert "rank 0's source is broken" in errors[1] and "keep serving" in errors[1]


def test_an_engine_worker_that_dies_mid_update_is_named_within_seconds(
    tiny_llama: Any, ranks: list[Any]
) -> None:
    """A worker killed while it waits for rank 1's shards: rank 0 learns it from
    the worker's alive token (not at the phase deadline, 290 s of 300 here), and
    the error names the engine, the worker and "died"."""

    def pid(worker: Any) -> int:  # nested: shipped by value
        return os.getpid()

    doomed = start_engine(tiny_llama[0], weight_transfer_config={"backend": "raydirect"})
    try:
        [worker_pid] = ray.get(doomed.collective_rpc.remote(pid), timeout=60)
        ray.get([r.trainer_init.remote([doomed], sharded=True, timeout=300) for r in ranks])
        mailbox = ray.get_actor("raydirect-vllm")
        pending = ranks[0].send_weights.remote()  # rank 1 holds its shards back
        # joined and waiting: rank 0 for the reports, the worker for the shards and
        # the decision
        deadline = time.monotonic() + 120
        while ray.get(mailbox.waiting.remote()) < 3:
            assert time.monotonic() < deadline, "the worker never joined"
            time.sleep(0.05)
        os.kill(worker_pid, signal.SIGKILL)
        error = ray.get(pending, timeout=60)  # within seconds, not the 290 s deadline
        assert "died during the receive phase" in error and "worker 0/1" in error, error
        assert "engine " in error and "version 1 was not applied" in error, error
        assert "died" in ray.get(ranks[1].send_weights.remote(), timeout=120)
    finally:
        ray.kill(doomed)


def test_a_rank_that_dies_mid_update_is_named(engine: Any, ranks: list[Any]) -> None:
    ray.get([r.trainer_init.remote([engine], sharded=True, timeout=60) for r in ranks])
    ray.get([r.step.remote() for r in ranks], timeout=60)
    assert ray.get([r.send_weights.remote() for r in ranks], timeout=300) == ["", ""]
    served = ray.get([r.full_state.remote() for r in ranks])[0]
    ray.get([r.step.remote() for r in ranks], timeout=60)
    pending = ranks[0].send_weights.remote()  # rank 0 starts the update...
    ray.kill(ranks[1])  # ...and rank 1 dies before its part of it
    error = ray.get(pending, timeout=120)
    assert "WeightSyncError" in error and "rank(s) [1] died" in error, error
    assert "keep serving" in error
    assert _serves(engine, served) < LOGPROB_TOLERANCE
    # The engine takes the next update, from another trainer.
    model = __import__("vllm_harness").random_llama(seed=31)
    trainer = WeightTransferTrainerFactory.trainer_init(
        RaydirectTrainerInitInfo(rank=0, timeout=60),
        client=RayVLLMWeightSyncClient([engine]),
        source=ModuleSource(model),
    )
    trainer.send_weights()
    assert _serves(engine, {k: v.detach() for k, v in model.state_dict().items()}) < 1e-5
    trainer.shutdown()
