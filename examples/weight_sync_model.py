"""Weight sync with a real model: a trainer steps a Llama, two tensor-parallel
inference actors load each version and compute the trainer's logits.

Run: ./dev python examples/weight_sync_model.py   (needs `transformers`; nothing is downloaded)

The trainer holds a small ``LlamaForCausalLM`` with random weights, takes
AdamW steps and publishes each version with ``rd.WeightPublisher``. Each
inference actor holds *its own half* of the model, 2-way tensor parallel as
Megatron splits it: a ``LlamaForCausalLM`` built with half the attention heads
and half the MLP width, so its q/k/v/gate/up weights are half the rows of the
trainer's (column-parallel) and its o/down weights half the columns
(row-parallel, a strided slice); embeddings, norms and the head are whole.
``rd.WeightSubscriber(model, shard=...)`` loads each version straight into
those parameters, moving only that half's bytes. A forward pass then runs
layer by layer: each rank computes its partial attention and MLP outputs, and
the driver sums them (the all-reduce of tensor parallelism) before the next
layer. The logits must equal the trainer's at every step.

Each version prints the bytes each rank received (``rd.local_stats()``): just
its shard, the same as the bytes of its own tensors (the embeddings and head
are whole on both ranks, so a rank holds about two thirds of the model here),
and whether the logits match the trainer's for the same fixed tokens
(``torch.allclose``, rtol 1e-4, atol 1e-5: the driver adds the partial sums in
another order than the trainer's matmuls, so the last bits may differ). The
logits must also change from one version to the next, so a rank that missed a
version could not pass. Exits 1 on any mismatch.
"""

from __future__ import annotations

import sys

import ray
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import raydirect as rd

WORLD = 2
STEPS = 3
CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "attn_implementation": "sdpa",
}
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split rows
ROW_PARALLEL = ("o_proj", "down_proj")  # split columns


def tensor_parallel(rank: int):
    """shard(name, full_shape) for rank ``rank`` of ``WORLD``."""

    def shard(name: str, full_shape: tuple[int, ...]):
        dim = 0 if any(k in name for k in COLUMN_PARALLEL) else None
        if any(k in name for k in ROW_PARALLEL):
            dim = 1
        if dim is None:
            return None  # replicated: embeddings, norms, lm_head
        part = full_shape[dim] // WORLD
        return (dim, rank * part, (rank + 1) * part)

    return shard


def tokens() -> torch.Tensor:
    return torch.randint(
        0, CONFIG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1)
    )


@ray.remote
class Trainer:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.publisher = rd.WeightPublisher(self.model)

    def step_and_publish(self, version: int):
        ids = tokens()
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()  # in place: the published snapshot is unaffected
        self.optimizer.zero_grad()
        return self.publisher.publish(version, timeout=60)

    @torch.no_grad()
    def logits(self) -> torch.Tensor:
        return self.model(input_ids=tokens()).logits


@ray.remote
class InferenceRank:
    def __init__(self, rank: int) -> None:
        half = dict(CONFIG, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
        self.model = LlamaForCausalLM(LlamaConfig(**half)).eval()
        self.subscriber = rd.WeightSubscriber(self.model, shard=tensor_parallel(rank))

    def load(self, handle) -> int:
        return self.subscriber.load(handle, timeout=60)

    def received(self) -> dict[str, int]:
        return rd.local_stats().bytes_received  # by transport, since the process started

    def shard_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.model.state_dict().values())

    @torch.no_grad()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(ids)

    @torch.no_grad()
    def attention(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        block = self.model.model.layers[layer]
        position = torch.arange(x.shape[1]).unsqueeze(0)
        rotary = self.model.model.rotary_emb(x, position)
        out, _ = block.self_attn(block.input_layernorm(x), position_embeddings=rotary)
        return out  # this rank's heads through its columns of o_proj: a partial sum

    @torch.no_grad()
    def mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        block = self.model.model.layers[layer]
        return block.mlp(block.post_attention_layernorm(x))  # a partial sum

    @torch.no_grad()
    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(x))


def tensor_parallel_logits(ranks: list) -> torch.Tensor:
    x = ray.get(ranks[0].embed.remote(tokens()))
    for layer in range(CONFIG["num_hidden_layers"]):
        x = x + sum(ray.get([r.attention.remote(layer, x) for r in ranks]))  # all-reduce
        x = x + sum(ray.get([r.mlp.remote(layer, x) for r in ranks]))
    return ray.get(ranks[0].head.remote(x))


def main() -> int:
    ray.init(logging_level="error")
    trainer = Trainer.remote()
    ranks = [InferenceRank.remote(r) for r in range(WORLD)]
    shard_bytes = ray.get([r.shard_bytes.remote() for r in ranks])
    before, previous = [0] * WORLD, None
    all_match = True
    for version in range(1, STEPS + 1):
        handle = trainer.step_and_publish.remote(version)  # a ref to the rd.WeightsHandle
        loaded = ray.get([r.load.remote(handle) for r in ranks])
        got, want = tensor_parallel_logits(ranks), ray.get(trainer.logits.remote())
        match = loaded == [version] * WORLD and torch.allclose(got, want, rtol=1e-4, atol=1e-5)
        # The step moved the weights, so a rank that missed a version could not match.
        moved = previous is None or not torch.allclose(want, previous, rtol=1e-4, atol=1e-5)
        all_match &= match and moved
        previous = want
        stats = ray.get([r.received.remote() for r in ranks])
        total = [sum(s.values()) for s in stats]
        step = [t - b for t, b in zip(total, before, strict=True)]
        before = total
        print(
            f"version {version}: bytes received per rank {step} over {'+'.join(sorted(stats[0]))} "
            f"(their shards: {shard_bytes}; the whole version: {ray.get(handle).nbytes})\n"
            f"  logits match the trainer's: {match} (max difference "
            f"{(got - want).abs().max().item():.1e}; changed since the last version: {moved})"
        )
    print(f"both ranks match the trainer at every step: {all_match}")
    ray.shutdown()
    return 0 if all_match else 1


if __name__ == "__main__":
    sys.exit(main())
