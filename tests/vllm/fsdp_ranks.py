"""A 2-rank FSDP2 trainer of the tiny Llama on gloo, as Ray actors: what the
sharded tests drive. Every rank builds the same random model and shards it
(``fully_shard`` per decoder layer and at the root), so each holds half of every
matrix's rows."""

from __future__ import annotations

import os
import socket
from typing import Any

import ray
import torch
import torch.distributed as dist
from vllm_harness import random_llama


@ray.remote(num_cpus=0)
class Rank:
    def __init__(self, rank: int, world: int, address: str, seed: int) -> None:
        from torch.distributed.fsdp import fully_shard

        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address.split(":")
        dist.init_process_group("gloo", rank=rank, world_size=world)
        self.rank = rank
        self.model = random_llama(seed)
        for layer in self.model.model.layers:
            fully_shard(layer)
        fully_shard(self.model)
        self.engine: Any = None

    def trainer_init(self, engines: list[Any], sharded: bool, timeout: float = 120) -> None:
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from raydirect.vllm import RaydirectTrainerInitInfo, ShardedModuleSource

        source = ShardedModuleSource(self.model) if sharded else ModuleSource(self.model)
        self.engine = WeightTransferTrainerFactory.trainer_init(
            RaydirectTrainerInitInfo(rank=self.rank, timeout=timeout),
            client=RayVLLMWeightSyncClient(engines),
            source=source,
        )

    def break_source(self) -> None:
        """This rank's source raises the next time it is read."""
        import functools

        from vllm.distributed.weight_transfer.base import WeightSource

        from raydirect.vllm import ParamMetas
        from raydirect.vllm.sources import metadata_of

        source, rank = self.engine.source, self.rank

        class Broken(WeightSource):
            metadata = functools.cached_property(lambda _self: ParamMetas(metadata_of(source)))

            def __iter__(self) -> Any:
                raise RuntimeError(f"rank {rank}'s source is broken")

            iter_full = iter_local = __iter__

        self.engine.source = Broken()

    def kept_bytes(self) -> int:
        """The bytes of the trainer's tensors this rank's engine still holds."""
        return sum(t.numel() * t.element_size() for t in self.engine._state.values())

    def step(self) -> None:
        """A training step's worth of change, in place, and a no-grad forward
        (which leaves FSDP2's parameters unsharded until resharded)."""
        with torch.no_grad():
            for p in self.model.parameters():
                p.to_local().mul_(1.02).add_(0.001)
            self.model(torch.tensor([[1, 2, 3]]))

    def send_weights(self) -> str:
        try:
            self.engine.send_weights()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return ""

    def _resharded(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole model (a collective: call on every rank)."""
        self._resharded()
        return {n: p.full_tensor().detach().clone() for n, p in self.model.named_parameters()}

    def shard_bytes(self) -> int:
        self._resharded()
        return sum(p.to_local().numel() * p.element_size() for p in self.model.parameters())

    def bytes_sent(self) -> int:
        import raydirect as rd

        return sum(rd.local_stats().bytes_sent.values())


def start_ranks(seed: int = 21, world: int = 2) -> list[Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [Rank.remote(r, world, f"127.0.0.1:{port}", seed) for r in range(world)]
