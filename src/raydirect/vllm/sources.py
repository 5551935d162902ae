"""A trainer's weights as each rank holds them: no gather."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource


class ShardedModuleSource(WeightSource):
    """``module.named_parameters()`` as this rank holds them. Where vLLM's
    ``ModuleSource`` calls ``full_tensor()`` on every FSDP2/DTensor parameter (an
    all-gather, so each rank ends up holding the whole model once per sync), this
    yields the DTensors themselves: each rank publishes only its local shards and
    each engine worker reads every byte from the rank that holds it.

    Only the ``raydirect`` backend understands what this yields (DTensors, not
    whole tensors). ``metadata()`` gives the global shapes, as ``ModuleSource``'s.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module

    def metadata(self) -> list[ParamMeta]:
        return [
            ParamMeta(name, p.dtype, tuple(p.shape)) for name, p in self._module.named_parameters()
        ]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        # FSDP2 leaves parameters unsharded after a forward without backward (or with
        # reshard_after_forward=False); resharding first makes each parameter its
        # rank's shard again, so the rank publishes only that.
        for sub in self._module.modules():
            reshard = getattr(sub, "reshard", None)
            if callable(reshard) and type(sub).__name__.startswith("FSDP"):
                reshard()
        yield from self._module.named_parameters()
