"""A model with tied embeddings (its head shares the embedding's tensor, as many
small models do): vLLM's loader fills the embedding and skips the head, and the
update must still land in both. An engine of its own, so the module runs alone."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch
from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm_harness import (
    LOGPROB_TOLERANCE,
    hf_prompt_logprobs,
    max_difference,
    prompt,
    random_llama,
    save_llama,
    start_engine,
)

from raydirect.vllm import RaydirectTrainerInitInfo

TIED = {"tie_word_embeddings": True}
IDS = prompt(24, 5)


@pytest.fixture(scope="module")
def tied_engine(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    path = tmp_path_factory.mktemp("tied-llama")
    save_llama(path, seed=0, **TIED)
    actor = start_engine(path, weight_transfer_config={"backend": "raydirect"})
    yield actor
    ray.kill(actor)


def test_tied_embeddings_update_both_ends(tied_engine: Any) -> None:
    model = random_llama(seed=21, **TIED)
    trainer = WeightTransferTrainerFactory.trainer_init(
        RaydirectTrainerInitInfo(rank=0, timeout=120),
        client=RayVLLMWeightSyncClient([tied_engine]),
        source=ModuleSource(model),
    )
    for _ in range(2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        trainer.send_weights()
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        got = ray.get(tied_engine.prompt_logprobs.remote(IDS), timeout=120)
        assert max_difference(got, hf_prompt_logprobs(state, IDS, **TIED)) < LOGPROB_TOLERANCE
    trainer.shutdown()
