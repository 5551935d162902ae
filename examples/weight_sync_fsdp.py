"""Weight sync from a sharded trainer: a Llama trained with FSDP2 on 2 ranks, two
tensor-parallel inference actors loading each version from both ranks at once.

Run: ./dev python examples/weight_sync_fsdp.py   (needs `transformers`; nothing is downloaded)

The trainer is two Ray actors, each a rank of its own ``torch.distributed``
world (gloo, rendezvous on a ``TCPStore`` that rank 0 opens on a free port).
Each holds a small ``LlamaForCausalLM`` with random weights, sharded by
``fully_shard`` over ``DeviceMesh("cpu", [0, 1])``: every parameter becomes a
DTensor placed ``Shard(0)``, each rank holding half of its rows. The ranks take
AdamW steps together and each publishes its own shards every step with
``rd.WeightPublisher(model)``: no ``placement`` is needed, the DTensors say
where each shard lies. Nothing is gathered to publish.

FSDP2 on CPU needs nothing special in torch 2.13: ``fully_shard(module,
mesh=DeviceMesh("cpu", ...))`` picks the CPU device and gloo's collectives from
the mesh (without ``mesh=`` it builds a default one, CUDA if present). The
default ``reshard_after_forward`` (True for the layers, False for the root)
is fine too: after ``optimizer.step()`` every parameter is the sharded DTensor
again, and ``model.state_dict()`` runs FSDP2's pre-hook that reshards any
that a forward left gathered. What to publish is the module itself:
raydirect reads its ``state_dict(keep_vars=True)`` at each publish, the
parameters themselves, and copies each DTensor's local shard
(``to_local()``, the optimizer's own memory, unpadded) into its slot. The
gathered (full) state dict of ``StateDictOptions(full_state_dict=True)`` would
be plain tensors that every rank holds whole: an all-gather per step, which
this avoids.

Each inference actor holds its own half of the model, 2-way tensor parallel as
in ``examples/weight_sync_model.py`` (q/k/v/gate/up: half the rows; o/down:
half the columns; embeddings, norms and head whole), and loads each version
with ``sub.load([handle_rank0, handle_rank1])``. Its plan intersects its
slices with each rank's rows: an o_proj column block takes half its rows from
each rank, the whole embedding its two halves from their owners. Only those
bytes move, each from the rank that holds it, both ranks read at once.

Checked at every version, printing each: the bytes each worker received
(``rd.local_stats()``) equal the bytes of its own tensors, its slice; the bytes
each rank sent (counted from the workers' read notices) add up to what the
workers received; the workers' combined logits match the trainer's
(``torch.allclose``, rtol 1e-4, atol 1e-5), for which, and only for which,
the ranks gather the full model (``DTensor.full_tensor()``) into a plain
Llama on rank 0; and the logits changed since the last version. Exits 1 on
any mismatch.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import ray
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import raydirect as rd

RANKS = 2  # FSDP2 ranks of the trainer
WORKERS = 2  # tensor-parallel inference actors
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
COUNTS_SETTLE_S = 10.0  # the ranks count their reads from notices sent after each read


def tensor_parallel(rank: int):
    """shard(name, global_shape) for worker ``rank`` of ``WORKERS``."""

    def shard(name: str, global_shape: tuple[int, ...]):
        dim = 0 if any(k in name for k in COLUMN_PARALLEL) else None
        if any(k in name for k in ROW_PARALLEL):
            dim = 1
        if dim is None:
            return None  # whole on every worker: embeddings, norms, lm_head
        part = global_shape[dim] // WORKERS
        return (dim, rank * part, (rank + 1) * part)

    return shard


def tokens() -> torch.Tensor:
    return torch.randint(
        0, CONFIG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1)
    )


def sent_bytes() -> int:
    return sum(rd.local_stats().bytes_sent.values())


def received_bytes() -> dict[str, int]:
    return rd.local_stats().bytes_received  # by transport, since the process started


@ray.remote
class TrainerRank:
    """One FSDP2 rank. ``open_store`` (rank 0 only), then ``join`` on every rank at once."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def open_store(self) -> int:
        # Port 0: the kernel picks a free one, so concurrent runs never collide.
        self.store = dist.TCPStore("127.0.0.1", 0, RANKS, is_master=True, wait_for_workers=False)
        return self.store.port

    def join(self, port: int) -> None:
        if self.rank != 0:
            self.store = dist.TCPStore("127.0.0.1", port, RANKS, is_master=False)
        dist.init_process_group(
            "gloo", store=self.store, rank=self.rank, world_size=RANKS, timeout=timedelta(60)
        )
        mesh = DeviceMesh("cpu", list(range(RANKS)))
        torch.manual_seed(0)  # the same initial weights on every rank, then sharded
        self.model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        for layer in self.model.model.layers:  # bottom-up: one all-gather per layer
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        # The module itself: its state_dict(keep_vars=True), read at each publish,
        # is the DTensor parameters, whose local shards are the optimizer's memory.
        self.publisher = rd.WeightPublisher(self.model)

    def step_and_publish(self, version: int):
        ids = tokens()  # the same batch on both ranks: FSDP averages their gradients
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()  # in place, on this rank's shards
        self.optimizer.zero_grad()
        return self.publisher.publish(version, timeout=60)  # this rank's handle

    def sent(self) -> int:
        return sent_bytes()

    def placements(self) -> list[str]:
        """What ``model.state_dict()`` holds under FSDP2: DTensors, and how they are placed."""
        state = self.model.state_dict()
        return sorted({f"{type(t).__name__}{getattr(t, 'placements', '')}" for t in state.values()})

    @torch.no_grad()
    def full_logits(self) -> torch.Tensor | None:
        """Only for the check: every rank gathers the full model (a collective),
        rank 0 runs it as a plain Llama."""
        full = {n: t.full_tensor() for n, t in self.model.state_dict().items()}
        if self.rank != 0:
            return None
        reference = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
        reference.load_state_dict(full)
        return reference(input_ids=tokens()).logits

    def close(self) -> None:
        dist.destroy_process_group()


@ray.remote
class InferenceRank:
    """Half of the model, 2-way tensor parallel (as in ``weight_sync_model.py``)."""

    def __init__(self, rank: int) -> None:
        half = dict(CONFIG, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
        self.model = LlamaForCausalLM(LlamaConfig(**half)).eval()
        self.subscriber = rd.WeightSubscriber(self.model, shard=tensor_parallel(rank))

    def load(self, handles: list) -> int:
        return self.subscriber.load(handles, timeout=60)  # one handle per trainer rank

    def received(self) -> dict[str, int]:
        return received_bytes()

    def slice_bytes(self) -> int:
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
        return out  # this worker's heads through its columns of o_proj: a partial sum

    @torch.no_grad()
    def mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        block = self.model.model.layers[layer]
        return block.mlp(block.post_attention_layernorm(x))  # a partial sum

    @torch.no_grad()
    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(x))


def tensor_parallel_logits(workers: list) -> torch.Tensor:
    x = ray.get(workers[0].embed.remote(tokens()))
    for layer in range(CONFIG["num_hidden_layers"]):
        x = x + sum(ray.get([w.attention.remote(layer, x) for w in workers]))  # all-reduce
        x = x + sum(ray.get([w.mlp.remote(layer, x) for w in workers]))
    return ray.get(workers[0].head.remote(x))


def settled_sent(ranks: list, received: int) -> list[int]:
    """Each rank's bytes sent, once they add up to ``received`` (or the wait ends)."""
    deadline = time.monotonic() + COUNTS_SETTLE_S
    sent = ray.get([r.sent.remote() for r in ranks])
    while sum(sent) != received and time.monotonic() < deadline:
        time.sleep(0.05)
        sent = ray.get([r.sent.remote() for r in ranks])
    return sent


def start_trainer() -> list:
    ranks = [TrainerRank.remote(r) for r in range(RANKS)]
    port = ray.get(ranks[0].open_store.remote())
    ray.get([r.join.remote(port) for r in ranks])  # all at once: init_process_group waits
    return ranks


def check_version(
    version: int, ranks: list, workers: list, handles: list, previous: torch.Tensor | None
) -> tuple[bool, torch.Tensor]:
    """Load ``version`` on every worker; return (all checks passed, the trainer's logits)."""
    received_before = [sum(s.values()) for s in ray.get([w.received.remote() for w in workers])]
    sent_before = ray.get([r.sent.remote() for r in ranks])
    loaded = ray.get([w.load.remote(handles) for w in workers])
    stats = ray.get([w.received.remote() for w in workers])
    received = [sum(s.values()) - b for s, b in zip(stats, received_before, strict=True)]
    sent_after = settled_sent(ranks, sum(sent_before) + sum(received))
    sent = [a - b for a, b in zip(sent_after, sent_before, strict=True)]
    slices = ray.get([w.slice_bytes.remote() for w in workers])
    got = tensor_parallel_logits(workers)
    want = ray.get([r.full_logits.remote() for r in ranks])[0]
    exact = received == slices and sum(sent) == sum(received)
    match = loaded == [version] * WORKERS and torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    # The step moved the weights, so a worker that missed a version could not match.
    moved = previous is None or not torch.allclose(want, previous, rtol=1e-4, atol=1e-5)
    whole = ray.get(handles[0]).nbytes + ray.get(handles[1]).nbytes
    print(
        f"version {version}: bytes received per worker {received} over "
        f"{'+'.join(sorted(stats[0]))} (their slices: {slices}; "
        f"equal: {received == slices}); bytes sent per rank {sent} (sum {sum(sent)}; "
        f"the whole model: {whole})\n"
        f"  logits match the trainer's: {match} (max difference "
        f"{(got - want).abs().max().item():.1e}; changed since the last version: {moved})"
    )
    return exact and match and moved, want


def main() -> int:
    ray.init(logging_level="error")
    ranks = start_trainer()
    print(f"each trainer rank's state_dict() holds {ray.get(ranks[0].placements.remote())}")
    workers = [InferenceRank.remote(w) for w in range(WORKERS)]
    all_good, previous = True, None
    for version in range(1, STEPS + 1):
        handles = [r.step_and_publish.remote(version) for r in ranks]  # both ranks step together
        good, previous = check_version(version, ranks, workers, handles, previous)
        all_good &= good
    print(f"both workers match the trainer at every step, each receiving its slice: {all_good}")
    ray.get([r.close.remote() for r in ranks])
    ray.shutdown()
    return 0 if all_good else 1


if __name__ == "__main__":
    sys.exit(main())
