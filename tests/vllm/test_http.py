"""An update driven over HTTP: a vLLM OpenAI server (started as its users start
it, with ``--weight-transfer-config '{"backend": "raydirect"}'``) and vLLM's
``HTTPVLLMWeightSyncClient``. The server is no Ray actor: its worker joins the
trainer's Ray cluster from the init info alone."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import torch
from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm_harness import (
    LOGPROB_TOLERANCE,
    hf_prompt_logprobs,
    max_difference,
    prompt,
    random_llama,
)
from vllm_servers import ApiServer, api_servers

import raydirect as rd
from raydirect.vllm import RaydirectTrainerInitInfo

IDS = prompt(24, 5)


@pytest.fixture(scope="module")
def server(ray_session: None, tiny_llama: Any, tmp_path_factory: Any) -> Iterator[str]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    served = ApiServer(
        tiny_llama[0],
        log,
        "--weight-transfer-config",
        json.dumps({"backend": "raydirect"}),
        env={"VLLM_SERVER_DEV_MODE": "1"},  # the RL routes
    )
    with api_servers(served):
        yield served.url


def _prompt_logprobs(url: str) -> list[float]:
    body = {"model": requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"],
            "prompt": IDS, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0.0}  # fmt: skip
    reply = requests.post(f"{url}/v1/completions", json=body, timeout=60)
    reply.raise_for_status()
    steps = reply.json()["choices"][0]["prompt_logprobs"][1:]
    return [step[str(tok)]["logprob"] for tok, step in zip(IDS[1:], steps, strict=True)]


def test_an_update_over_http(server: str) -> None:
    model = random_llama(seed=41)
    trainer = WeightTransferTrainerFactory.trainer_init(
        RaydirectTrainerInitInfo(rank=0, timeout=120),
        client=HTTPVLLMWeightSyncClient(server, timeout=300),
        source=ModuleSource(model),
    )
    for _ in range(2):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.03)
        trainer.send_weights()
        want = hf_prompt_logprobs({k: v.detach() for k, v in model.state_dict().items()}, IDS)
        assert max_difference(_prompt_logprobs(server), want) < LOGPROB_TOLERANCE
    # A refusal reaches the caller over HTTP too, and the server keeps serving.
    served = _prompt_logprobs(server)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    state["model.norm.weight"] = torch.ones(state["model.norm.weight"].shape[0] + 8)
    bad = WeightTransferTrainerFactory.trainer_init(
        RaydirectTrainerInitInfo(rank=0, timeout=60),
        client=HTTPVLLMWeightSyncClient(server, timeout=300),
        source=ModuleSource(_Dict(state)),
    )
    with pytest.raises(rd.WeightSyncError, match="was not applied.*model.norm.weight"):
        bad.send_weights()
    assert max_difference(_prompt_logprobs(server), served) < LOGPROB_TOLERANCE
    bad.shutdown()


class _Dict(torch.nn.Module):
    """A module whose parameters are the given tensors (ModuleSource reads them)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.state = state

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        yield from self.state.items()
