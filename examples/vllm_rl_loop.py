"""A small RL loop on CPU: vLLM samples, a 2-rank FSDP2 trainer learns, raydirect
moves the new weights into the engine, and vLLM samples again.

- the policy: a tiny random Llama (written with ``save_pretrained``, nothing
  downloaded), served by a vLLM engine in a Ray actor with the weight-transfer
  backend ``"raydirect"``;
- the trainer: two Ray actors, one torch.distributed rank each (gloo), the model
  ``fully_shard``-ed over them (FSDP2: every parameter a DTensor, each rank
  holding half of its rows);
- the reward: the share of a completion's tokens that are even ids (anything a
  program can check would do); one REINFORCE step per iteration;
- the sync: ``send_weights()`` on both ranks with ``ShardedModuleSource``: each
  rank publishes only its own shards, nothing is gathered, and the engine's
  worker pulls the rows straight from the rank that holds them.

After each sync the engine scores the completions it sampled: their log-probs
move toward the rewarded ones, and equal the trainer's own to float32 rounding.

Needs vLLM (the CPU build here): ``bash scripts/setup-vllm-venv.sh`` and then
``.venv-vllm/bin/python examples/vllm_rl_loop.py``. About a minute, most of it the
engine's start.
"""

from __future__ import annotations

import os
import socket
import tempfile
from typing import Any

import ray
import torch

STEPS = 3
SAMPLES = 8  # completions per step, half to each trainer rank
COMPLETION = 8  # tokens per completion
LR = 0.05
TINY_LLAMA = {  # head_dim 32: the smallest vLLM's CPU attention takes
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


def reward(tokens: list[int]) -> float:
    return sum(1 for t in tokens if t % 2 == 0) / len(tokens)


@ray.remote(num_cpus=0)
class Policy:
    """The vLLM engine: the methods vLLM's ``RayVLLMWeightSyncClient`` calls (the
    ``LLM`` has them), sampling, and scoring completions."""

    def __init__(self, model: str) -> None:
        os.environ.update(VLLM_ENV)
        # vLLM's workers on CPU are processes of this one: the backend joins Ray there
        os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
        from vllm import LLM

        self.llm = LLM(
            model=model,
            dtype="float32",  # bf16 is not supported by every CPU
            skip_tokenizer_init=True,
            max_model_len=128,
            enforce_eager=True,
            weight_transfer_config={"backend": "raydirect"},
        )

    def init_weight_transfer_engine(self, request: Any) -> None:
        self.llm.init_weight_transfer_engine(request)

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, request: Any) -> None:
        self.llm.update_weights(request)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def update_weight_version(self, version: str) -> None:
        self.llm.update_weight_version(version)

    def sample(self, prompt: list[int], n: int, seed: int) -> list[list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(n=n, max_tokens=COMPLETION, seed=seed, ignore_eos=True)
        [out] = self.llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        return [list(c.token_ids) for c in out.outputs]

    def score(self, prompt: list[int], completions: list[list[int]]) -> list[float]:
        """Each completion's log-probability after ``prompt``."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0)
        seqs = [{"prompt_token_ids": prompt + c} for c in completions]
        outs = self.llm.generate(seqs, params, use_tqdm=False)
        return [
            sum(s[t].logprob for t, s in zip(c, out.prompt_logprobs[len(prompt) :], strict=True))
            for c, out in zip(completions, outs, strict=True)
        ]


@ray.remote(num_cpus=0)
class TrainerRank:
    """One rank of the FSDP2 trainer."""

    def __init__(self, model: str, rank: int, world: int, address: str) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import LlamaForCausalLM

        self.rank, self.world = rank, world
        dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        self.model = LlamaForCausalLM.from_pretrained(model, dtype=torch.float32)
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LR)

    def connect(self, engines: list[Any]) -> None:
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from raydirect.vllm import RaydirectTrainerInitInfo, ShardedModuleSource

        self.sync = WeightTransferTrainerFactory.trainer_init(
            RaydirectTrainerInitInfo(rank=self.rank),  # the rest from torch.distributed
            client=RayVLLMWeightSyncClient(engines),
            source=ShardedModuleSource(self.model),  # this rank's shards, no gather
        )

    def _logprobs(self, prompt: list[int], completions: list[list[int]]) -> torch.Tensor:
        ids = torch.tensor([prompt + c for c in completions])
        logits = self.model(ids).logits[:, len(prompt) - 1 : -1]
        logp = torch.log_softmax(logits.float(), dim=-1)
        return logp.gather(2, ids[:, len(prompt) :, None])[..., 0].sum(dim=1)

    def train_step(self, prompt: list[int], completions: list[list[int]]) -> None:
        """REINFORCE on this rank's half of the batch; FSDP averages the gradients."""
        rewards = torch.tensor([reward(c) for c in completions])
        advantages = rewards - rewards.mean()
        mine = slice(self.rank, None, self.world)
        loss = -(advantages[mine] * self._logprobs(prompt, completions[mine])).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def send_weights(self) -> None:
        self.sync.send_weights()

    @torch.no_grad()
    def score(self, prompt: list[int], completions: list[list[int]]) -> list[float]:
        return self._logprobs(prompt, completions).tolist()


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    ray.init(include_dashboard=False, logging_level="warning")
    with tempfile.TemporaryDirectory() as where:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(where)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        policy = Policy.remote(where)
        ranks = [TrainerRank.remote(where, r, 2, address) for r in range(2)]
        ray.get([r.connect.remote([policy]) for r in ranks])  # every rank, once
        prompt = list(range(1, 17))
        moved, matched = True, True
        for step in range(STEPS):
            completions = ray.get(policy.sample.remote(prompt, SAMPLES, seed=step))
            rewards = [reward(c) for c in completions]
            before = ray.get(policy.score.remote(prompt, completions))
            ray.get([r.train_step.remote(prompt, completions) for r in ranks])
            ray.get([r.send_weights.remote() for r in ranks])  # both ranks; rank 0 drives
            after = ray.get(policy.score.remote(prompt, completions))
            trainer = ray.get([r.score.remote(prompt, completions) for r in ranks])[0]
            mean = sum(rewards) / len(rewards)
            better = [a - b for a, b, r in zip(after, before, rewards, strict=True) if r > mean]
            worse = [a - b for a, b, r in zip(after, before, rewards, strict=True) if r < mean]
            gap = max(abs(a - t) for a, t in zip(after, trainer, strict=True))
            print(
                f"step {step}: mean reward {mean:.2f}; after the sync the engine's log-prob "
                f"of completions rewarded above it moved {_mean(better):+.3f}, below it "
                f"{_mean(worse):+.3f}; engine vs trainer {gap:.1e}"
            )
            moved = moved and _mean(better) > 0 > _mean(worse)
            matched = matched and gap < 1e-3
        print(f"the engine's log-probs moved toward the reward at every step: {moved}")
        print(f"the engine's log-probs equal the trainer's after every sync: {matched}")
    ray.shutdown()


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


if __name__ == "__main__":  # vLLM starts processes of its own
    main()
