"""The trainer side: each rank publishes a version, rank 0 drives the engines.

``send_weights`` on every rank: take the source's tensors (for vLLM's
``ModuleSource`` the FSDP gather runs here, on every rank, as in vLLM's own
backends), publish them as one new version with ``rd.WeightPublisher`` (no copy:
the tensors stay where they are until the engines have read them), and leave the
handle in the mailbox. Rank 0 then drives the engines through the client
(``start_weight_update``, ``update_weights({"version": v, ...})``,
``finish_weight_update(str(v))``) and tells the other ranks how it ended, so an
error reaches the caller of ``send_weights`` on every rank.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar

import ray
import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

import raydirect as rd
from raydirect.vllm.mailbox import Mailbox
from raydirect.vllm.plugin import BACKEND
from raydirect.vllm.sources import ShardedModuleSource

_SHOWN = 3  # dead ranks or names listed in one message


@dataclass
class RaydirectTrainerInitInfo(TrainerInitInfo):
    """What a trainer rank passes to ``WeightTransferTrainerFactory.trainer_init``.

    ``rank`` is this trainer process's rank (rank 0 drives the engines); the number
    of ranks comes from torch.distributed's default group (1 without one).
    ``name`` names the mailbox actor in Ray (two trainers driving different
    engines in one Ray namespace need different names). ``timeout`` bounds every
    wait of an update, in seconds. ``tensor_transport``: how the engines' workers
    read the bytes (``"auto"`` picks per pair: cross-memory on one node, tcp
    across). ``dtype`` (e.g. ``"bfloat16"``) casts floating-point tensors as they
    are published, into a buffer of their own; ``None`` publishes them in place.
    """

    backend: ClassVar[str] = BACKEND

    name: str = "raydirect-vllm"
    timeout: float = 300.0
    tensor_transport: str = "auto"
    dtype: str | None = None


def _ray_ready() -> None:
    if not ray.is_initialized():
        raise rd.WeightSyncError(
            "the raydirect backend publishes through Ray: call ray.init() (or run the "
            "trainer in a Ray actor) before trainer_init"
        )


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    if _world() > 1:
        dist.barrier()


def _mailbox_at_rank0(name: str, ranks: int) -> Any:
    """Rank 0's mailbox, made fresh: one left by an earlier trainer of the same
    name is replaced (its versions are of no use to this one). Rank 0 owns it, so
    it goes when rank 0 does: nothing is left behind."""
    with contextlib.suppress(ValueError):  # none yet
        ray.kill(ray.get_actor(name))
    return Mailbox.options(name=name).remote(ranks)  # type: ignore[attr-defined]


class RaydirectTrainerWeightTransferEngine(TrainerWeightTransferEngine[RaydirectTrainerInitInfo]):
    """The trainer-side engine of the ``raydirect`` backend (see the module docstring)."""

    init_info_cls = RaydirectTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
        is_sender: bool = True,
        info: RaydirectTrainerInitInfo | None = None,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = info or RaydirectTrainerInitInfo(rank=0)
        self.version = 0
        sharded = isinstance(source, ShardedModuleSource)
        # A gathering source gives every rank the whole model: rank 0 alone publishes.
        self.publishes = sharded or self.info.rank == 0
        self.ranks = _world() if sharded else 1
        self._state: dict[str, torch.Tensor] = {}
        self._publisher: rd.WeightPublisher | None = None
        self._token = ray.put(self.info.rank) if ray.is_initialized() else None
        self.mailbox: Any = None

    @classmethod
    def trainer_init(
        cls,
        init_info: RaydirectTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> RaydirectTrainerWeightTransferEngine:
        if source is None:
            raise ValueError(
                "the raydirect backend sends a WeightSource each round: pass source= "
                "(vLLM's ModuleSource, or raydirect.vllm.ShardedModuleSource for FSDP2 "
                "without a gather)"
            )
        _ray_ready()
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info)
        if engine.is_sender:
            engine.mailbox = _mailbox_at_rank0(init_info.name, engine.ranks)
            ray.get(engine.mailbox.ranks.remote())  # it is up before the others look
        _barrier()
        if not engine.is_sender:
            engine.mailbox = ray.get_actor(init_info.name)
        if engine.publishes:
            ray.get(engine.mailbox.alive.remote(init_info.rank, [engine._token]))
        _barrier()
        if engine.is_sender:
            context = ray.get_runtime_context()
            engine.client.init_weight_transfer_engine(
                {
                    "name": init_info.name,
                    "namespace": context.namespace,
                    "address": context.gcs_address,
                    "timeout": float(init_info.timeout),
                }
            )
        return engine

    def send_weights(self) -> None:
        """Publish one new version and apply it in every engine; raises
        ``rd.WeightSyncError`` naming what went wrong, on every rank."""
        assert self.source is not None
        self.version += 1
        version, info = self.version, self.info
        try:
            # Every rank iterates: for a gathering source that is a collective.
            self._state.update(self.source)
            if self.publishes:
                handle = self._publish(version)
                ray.get(self.mailbox.put.remote(version, info.rank, [handle]))
        except Exception as exc:
            if self.mailbox is not None and self.publishes:
                self.mailbox.fail.remote(version, info.rank, f"{type(exc).__name__}: {exc}")
            raise
        if self.is_sender:
            self._drive(version)
            return
        try:
            error = ray.get(self.mailbox.outcome.remote(version, info.timeout))
        except ray.exceptions.RayActorError:
            error = "trainer rank 0, which drives the engines (and holds the mailbox), died"
        if error:
            raise rd.WeightSyncError(f"version {version} was not applied: {error}")

    def _publish(self, version: int) -> rd.WeightsHandle:
        if self._publisher is None:
            dtype = None if self.info.dtype is None else getattr(torch, self.info.dtype)
            self._publisher = rd.WeightPublisher(
                self._state,
                depth=0 if dtype is None else 1,
                dtype=dtype,
                tensor_transport=self.info.tensor_transport,
            )
        return self._publisher.publish(version, timeout=self.info.timeout)

    def _drive(self, version: int) -> None:
        """Rank 0: the engines' round trip for ``version``, its outcome to the others."""
        assert self.source is not None
        meta = self.source.metadata()
        dtype = self.info.dtype
        update = {
            "version": version,
            "ranks": self.ranks,
            "names": [m.name for m in meta],
            "dtype_names": [dtype or str(m.dtype).removeprefix("torch.") for m in meta],
            "shapes": [list(m.shape) for m in meta],
        }
        try:
            self.client.start_weight_update()
            self.client.update_weights(update)
            self.client.finish_weight_update(str(version))
        except Exception as exc:
            error = self._explain(version, exc)
            self.mailbox.done.remote(version, error)
            raise rd.WeightSyncError(error) from exc
        ray.get(self.mailbox.done.remote(version, ""))

    def _explain(self, version: int, exc: BaseException) -> str:
        try:
            dead = ray.get(self.mailbox.dead_ranks.remote(), timeout=10)
        except ray.exceptions.RayError:
            dead = []
        said = str(exc).strip().splitlines()
        body = getattr(getattr(exc, "response", None), "text", None)
        if isinstance(body, str):  # HTTP: the server's answer says what went wrong
            said += body.replace("\\n", "\n").splitlines()
        # A worker's error arrives wrapped by vLLM's RPC and Ray: its last line is ours.
        last = said[-1] if said else ""
        cause = next((line for line in reversed(said) if "raydirect" in line), last)
        where = f"trainer rank(s) {dead[:_SHOWN]} died; " if dead else ""
        return (
            f"version {version} was not applied: {where}{type(exc).__name__}: {cause}. "
            "The engines keep serving the weights they held before this update"
        )

    def shutdown(self) -> None:
        """Releases the published tensors and, on rank 0, the mailbox."""
        self._publisher, self._state = None, {}
        if self.is_sender and self.mailbox is not None:
            ray.kill(self.mailbox)
            self.mailbox = None
