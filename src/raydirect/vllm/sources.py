"""A trainer's weights as each rank holds them: no gather; and a source as
either of vLLM's weight-transfer APIs gives it.

vLLM 0.33 redesigned sources: ``metadata`` became a ``functools.cached_property``
(0.32's engines call ``metadata()``), and ``__iter__`` gave way to
``iter_full()`` / ``iter_local()``. On 0.33 a source's metadata says which ranks
own each parameter and how it is cut (``ParamMeta.owners``, ``mesh_shape``,
``placements``), and ``iter_local()`` yields each rank's piece: vLLM's own
``ModuleSource`` does so over DTensors. ``placement_of`` turns that description
into the placement a ``rd.WeightPublisher`` takes, so each rank publishes only
what it holds. On vLLM 0.32 ``ShardedModuleSource`` yields the DTensors
themselves.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import ModuleSource, ParamMeta, WeightSource

import raydirect as rd

Spot = tuple[tuple[int, ...], int, int]  # (global shape, dim, start): WeightPublisher's placement

# 0.33's API: sources say which of iter_full / iter_local they implement.
SPLIT_ITERATION = hasattr(WeightSource, "implements_iter_local")
# 0.33's ParamMeta says which trainer ranks own a parameter, and how it is cut.
PLACED_METAS = "owners" in getattr(ParamMeta, "__dataclass_fields__", {})


class ParamMetas(list[ParamMeta]):
    """A source's metadata as both APIs read it: 0.33's engines read the cached
    property (this list), 0.32's call it (``metadata()`` returns the same list)."""

    def __call__(self) -> ParamMetas:
        return self


def metadata_of(source: WeightSource) -> list[ParamMeta]:
    """``source``'s metadata under either API (0.33: a property; 0.32: a method)."""
    metadata: Any = source.metadata
    return list(metadata() if callable(metadata) else metadata)


def local_pieces(source: WeightSource) -> bool:
    """Whether ``source`` yields each rank's own pieces (0.33's ``iter_local``
    over a sharded model, described by its metadata's owners and placements)."""
    if not (SPLIT_ITERATION and PLACED_METAS):
        return False
    either: Any = source  # typed against one of the two APIs only
    if not either.implements_iter_local():
        return False
    return any(getattr(m, "owners", None) is not None for m in metadata_of(source))


def tensors_of(source: WeightSource, local: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """One pass over ``source``: its local pieces (``local``), else full tensors
    (0.33's ``iter_full``, 0.32's ``__iter__``)."""
    either: Any = source  # typed against one of the two APIs only
    if not SPLIT_ITERATION:
        return iter(either)
    full = either.implements_iter_full()
    if (local or not full) and either.implements_iter_local():
        return either.iter_local()
    if full:
        return either.iter_full()
    raise TypeError(
        f"{type(source).__name__} implements neither iter_full nor iter_local: the "
        "raydirect backend publishes what one of them yields"
    )


def resharded(module: torch.nn.Module) -> None:
    """FSDP2 leaves parameters unsharded after a forward without backward (or with
    ``reshard_after_forward=False``): resharding first makes each parameter its
    rank's shard again, so the rank publishes only that (and what its source's
    metadata places)."""
    for sub in module.modules():
        reshard = getattr(sub, "reshard", None)
        if callable(reshard) and type(sub).__name__.startswith("FSDP"):
            reshard()


def module_of(source: WeightSource) -> torch.nn.Module | None:
    """The module a module source reads (ours, or vLLM's ``ModuleSource``)."""
    module = getattr(source, "_module", None)
    return module if isinstance(module, torch.nn.Module) else None


def unfunnelled(source: WeightSource) -> WeightSource:
    """``source``, or where it is vLLM 0.32's ``ModuleSource`` over DTensors, a
    ``ShardedModuleSource`` over its module. 0.32's iteration gathers every
    parameter on every rank (``full_tensor()``), so one rank would hold and
    publish the whole model; read as its shards, each rank publishes its own.
    The engines get the same tensors either way (on 0.33 vLLM's source yields
    the shards itself)."""
    if SPLIT_ITERATION or type(source) is not ModuleSource:
        return source
    module = module_of(source)
    if module is None or not any(hasattr(p, "to_local") for p in module.parameters()):
        return source
    return ShardedModuleSource(module)


class ShardedModuleSource(WeightSource):
    """``module.named_parameters()`` as this rank holds them. Where vLLM 0.32's
    ``ModuleSource`` calls ``full_tensor()`` on every FSDP2/DTensor parameter (an
    all-gather, so each rank ends up holding the whole model once per sync), this
    yields the DTensors themselves: each rank publishes only its local shards and
    each engine worker reads every byte from the rank that holds it.

    Valid under both of vLLM's source APIs: ``metadata`` is a cached property
    that 0.32's engines may also call; on 0.33 it records owners and placements
    as vLLM's ``ModuleSource`` does, and ``iter_local()`` yields each rank's
    pieces (on 0.33 vLLM's ``ModuleSource`` serves as well). Only the
    ``raydirect`` backend understands what 0.32's iteration yields (DTensors).
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module

    @functools.cached_property
    def metadata(self) -> ParamMetas:
        if PLACED_METAS:  # 0.33: owners and placements, as vLLM records them
            return ParamMetas(metadata_of(ModuleSource(self._module)))
        return ParamMetas(
            ParamMeta(name, p.dtype, tuple(p.shape)) for name, p in self._module.named_parameters()
        )

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        resharded(self._module)
        yield from self._module.named_parameters()

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        resharded(self._module)
        vllms: Any = ModuleSource(self._module)  # 0.33's, which has iter_local
        yield from vllms.iter_local()


def placement_of(meta: ParamMeta, rank: int) -> Spot | None:
    """Where ``rank``'s piece of ``meta`` lies in the whole tensor: None (it holds
    all of it), else ``(global shape, dim, start)``, cut as ``torch.chunk`` cuts
    along each sharding mesh axis, the outer axis first (vLLM 0.33's contract)."""
    placed: Any = meta  # 0.33's ParamMeta (0.32's has no owners: whole tensors)
    owners = getattr(placed, "owners", None)
    placements = getattr(placed, "placements", None)
    if owners is None or placements is None:
        return None
    mesh = tuple(placed.mesh_shape)
    index, coords = owners.index(rank), list[int]()
    for extent in reversed(mesh):  # row-major: the last axis varies fastest
        index, coord = divmod(index, extent)
        coords.insert(0, coord)
    dims = {p.dim for p in placements if hasattr(p, "dim")}
    if len(dims) != 1:
        raise rd.WeightSyncError(
            f"{meta.name}: its placements {placements} shard {len(dims)} dimensions; the "
            "raydirect backend publishes pieces cut along one (Shard(d) on any mesh axes, "
            "Replicate on the others): redistribute it, or use ShardedModuleSource"
        )
    (dim,) = dims
    start, size = 0, meta.shape[dim]
    for axis, placement in enumerate(placements):
        if hasattr(placement, "dim"):
            chunk = math.ceil(size / mesh[axis]) if size else 0
            low = min(coords[axis] * chunk, size)
            start, size = start + low, min(low + chunk, size) - low
    return tuple(meta.shape), dim, start


def placements_by_name(source: WeightSource, rank: int) -> dict[str, Spot | None]:
    """``placement_of`` for every parameter ``rank`` owns."""
    metas: list[Any] = metadata_of(source)
    return {
        m.name: placement_of(m, rank)
        for m in metas
        if getattr(m, "owners", None) is None or rank in m.owners
    }
