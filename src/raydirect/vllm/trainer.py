"""The trainer side: each rank publishes a version, rank 0 drives the engines.

``send_weights`` on every rank takes the source's tensors and, where the rank
publishes, publishes them as one new version with ``rd.WeightPublisher`` (no
copy) and leaves the handle in the mailbox. A sharded model's ranks each
publish their own shards, whichever source reads it (vLLM 0.32's
``ModuleSource`` over DTensors is read as ``ShardedModuleSource``: no rank
gathers the model); a source of whole tensors is published by rank 0 alone. Rank 0
then runs the update in two phases (``rounds.drive``): every worker of every
engine receives and checks without touching a serving tensor; only if all of
them succeeded does any of them load. Every rank returns or raises only once no
engine worker can still read its tensors, and within ``timeout`` in all.
"""

from __future__ import annotations

import contextlib
import inspect
import time
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
from raydirect.vllm.mailbox import RaydirectMailbox
from raydirect.vllm.plugin import BACKEND
from raydirect.vllm.rounds import Round, drive, reserve_for_closing
from raydirect.vllm.sources import (
    ShardedModuleSource,
    local_pieces,
    metadata_of,
    module_of,
    placements_by_name,
    resharded,
    tensors_of,
    unfunnelled,
)

# vLLM 0.33's trainer engine is told its rank (0.32's reads every rank as 0).
RANKED_TRAINER = "rank" in inspect.signature(TrainerWeightTransferEngine.__init__).parameters


@dataclass
class RaydirectTrainerInitInfo(TrainerInitInfo):
    """What a trainer rank passes to ``WeightTransferTrainerFactory.trainer_init``.

    ``rank`` is this trainer process's rank (rank 0 drives the engines); the number
    of ranks comes from torch.distributed's default group (1 without one).
    ``name`` names the mailbox actor in Ray (two trainers driving different
    engines in one Ray namespace need different names). ``timeout`` bounds a whole
    update as each rank sees it, in seconds: ``send_weights`` returns or raises
    within it. ``tensor_transport``: how the engines' workers read the bytes
    (``"auto"`` picks per pair: cross-memory on one node, tcp across).
    ``dtype`` (e.g. ``"bfloat16"``) casts floating-point tensors as they are
    published, into a buffer of their own; ``None`` publishes them in place.
    ``keep_staging`` (default True): each engine worker keeps the memory it
    receives into between updates, which makes the next update about 4x faster
    here (benchmarks/vllm_staging.py); ``False`` frees it once each update has
    loaded or been dropped, for an engine short of memory.
    ``host_staging``: a GPU engine's workers receive a GPU trainer's tensors
    into pinned host memory instead of GPU memory (docs/vllm.md, What an update
    costs in memory).
    """

    backend: ClassVar[str] = BACKEND

    name: str = "raydirect-vllm"
    timeout: float = 300.0
    tensor_transport: str = "auto"
    dtype: str | None = None
    keep_staging: bool = True
    host_staging: bool = False

    def __post_init__(self) -> None:
        for key in ("keep_staging", "host_staging"):  # a config's "false" is truthy
            if not isinstance(getattr(self, key), bool):
                raise TypeError(
                    f"RaydirectTrainerInitInfo.{key} is True or False, got {getattr(self, key)!r}"
                )


_NAME_FREED_S = 30.0  # for Ray to let go the name of an earlier trainer's mailbox
_NAME_POLL_S = 0.01


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


def _mailbox_at_rank0(name: str, ranks: int, timeout: float) -> Any:
    """Rank 0's mailbox, made fresh: one left by an earlier trainer of the same
    name is replaced (its versions are of no use to this one). Rank 0 owns it, so
    it goes when rank 0 does: nothing is left behind. ``ray.kill`` returns before
    Ray lets the name go, so the new one is made once it has: made at once, it
    failed now and then with ``ActorAlreadyExistsError``."""
    deadline = time.monotonic() + _NAME_FREED_S
    while True:
        with contextlib.suppress(ValueError):  # none there (any more)
            ray.kill(ray.get_actor(name))
        with contextlib.suppress(ray.exceptions.ActorAlreadyExistsError):  # not let go yet
            return RaydirectMailbox.options(name=name).remote(ranks, timeout)  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            raise rd.WeightSyncError(
                f"the mailbox {name!r} of an earlier trainer still holds its name "
                f"{_NAME_FREED_S:.0f} s after it was killed: is another trainer of that name "
                "starting? Give each trainer its own name= in its init info"
            )
        time.sleep(_NAME_POLL_S)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The memory this rank holds of ``tensor`` (a DTensor's local shard)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


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
        self.info = info or RaydirectTrainerInitInfo(rank=0)
        source = None if source is None else unfunnelled(source)
        ranked = {"rank": self.info.rank} if RANKED_TRAINER else {}  # vLLM 0.33 takes it
        super().__init__(client=client, source=source, is_sender=is_sender, **ranked)
        self.version = 0
        # vLLM 0.33's sources over a sharded model yield each rank's pieces, which
        # their metadata places: every rank publishes its own (so with
        # ShardedModuleSource on 0.32, whose DTensors say where they lie).
        self.local = source is not None and local_pieces(source)
        sharded = isinstance(source, ShardedModuleSource) or self.local
        # A gathering source gives every rank the whole model: rank 0 alone publishes.
        self.publishes = sharded or self.info.rank == 0
        self.ranks = _world() if sharded else 1
        # This step's tensors, by name: rebuilt each step (a name the source no
        # longer yields is not published again) and emptied once the engines have
        # read them (a gathered copy is not kept between steps).
        self._state: dict[str, torch.Tensor] = {}
        self._publisher: rd.WeightPublisher | None = None
        self._token = ray.put(self.info.rank) if ray.is_initialized() else None
        self.mailbox: Any = None
        self._round: Round | None = None

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
                "(vLLM's ModuleSource, or raydirect.vllm.ShardedModuleSource)"
            )
        _ray_ready()
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info)
        if engine.is_sender:
            engine.mailbox = _mailbox_at_rank0(init_info.name, engine.ranks, init_info.timeout)
            ray.get(engine.mailbox.ranks.remote())  # it is up before the others look
        _barrier()
        if not engine.is_sender:
            engine.mailbox = ray.get_actor(init_info.name)
        if engine.publishes:
            ray.get(engine.mailbox.alive.remote(init_info.rank, [engine._token]))
        _barrier()
        if engine.is_sender:
            engine._round = Round.at_init(client, engine.mailbox, init_info, engine.ranks)
        return engine

    def send_weights(self) -> None:
        """Publish one new version and apply it in every engine, all or nothing;
        raises ``rd.WeightSyncError`` naming what went wrong, on every rank. Returns
        or raises within ``timeout``, and only once no engine worker can still
        read this rank's tensors."""
        assert self.source is not None
        deadline = time.monotonic() + self.info.timeout
        self.version += 1
        version, info = self.version, self.info
        try:
            self._snapshot()
            if self.publishes:
                handle = self._publish(version)
                # not waited for: the workers' take waits for every rank's handle
                self.mailbox.put.remote(version, info.rank, [handle])
                del handle  # the mailbox and the workers hold it now
        except Exception as exc:
            if self.mailbox is not None:
                with contextlib.suppress(Exception):
                    self.mailbox.fail.remote(version, info.rank, f"{type(exc).__name__}: {exc}")
            self._state.clear()
            raise rd.WeightSyncError(
                f"version {version} was not applied: trainer rank {info.rank} could not "
                f"publish it ({type(exc).__name__}: {exc}). The engines keep serving the "
                "weights they held before this update"
            ) from exc
        if self.is_sender:
            error = self._drive(version, deadline)
        else:
            error = self._outcome(version, deadline)
        if error:  # a worker may still be reading: wait until none holds the tensors
            raise rd.WeightSyncError(_joined(error, self._release(version, deadline)))
        # Applied: every worker of every engine reported its reads over; the
        # tensors are the caller's again (the last handles go in the background).
        self._state.clear()

    def _snapshot(self) -> None:
        """This step's tensors. Every rank iterates (for a gathering source that is
        a collective); a rank that does not publish keeps none of them."""
        assert self.source is not None
        if not self.publishes:
            for _name, _tensor in tensors_of(self.source, self.local):
                pass
            return
        self._state.clear()
        module = module_of(self.source)
        if self.local and module is not None:  # pieces as the metadata placed them
            resharded(module)
        self._state.update(tensors_of(self.source, self.local))

    def _publish(self, version: int) -> rd.WeightsHandle:
        if self._publisher is None:
            assert self.source is not None
            dtype = None if self.info.dtype is None else getattr(torch, self.info.dtype)
            spots = placements_by_name(self.source, self.info.rank) if self.local else None
            self._publisher = rd.WeightPublisher(
                self._state,
                depth=0 if dtype is None else 1,
                dtype=dtype,
                tensor_transport=self.info.tensor_transport,
                placement=None if spots is None else lambda name, _shape: spots.get(name),
            )
        return self._publisher.publish(version, timeout=self.info.timeout)

    def _drive(self, version: int, deadline: float) -> str:
        """Rank 0: the engines' round trip for ``version``; its outcome goes to the
        other ranks through the mailbox."""
        assert self.source is not None and self._round is not None
        devices = {_local(t).device.type for t in self._state.values()}
        error = f"version {version} was not applied: the update was interrupted"
        try:
            error = drive(self._round, version, metadata_of(self.source), devices, deadline)
        except Exception as exc:  # the mailbox or Ray itself failed: say so, everywhere
            error = f"version {version} was not applied: {type(exc).__name__}: {exc}"
        finally:  # the other ranks wait for it, and engines refuse other trainers until it
            with contextlib.suppress(Exception):
                self.mailbox.done.remote(version, error)
        return error

    def _outcome(self, version: int, deadline: float) -> str:
        """The other ranks: how rank 0's round ended, as soon as it is known."""
        wait = max(_left(deadline) - reserve_for_closing(self.info.timeout) / 2, 0.0)
        try:
            return str(ray.get(self.mailbox.outcome.remote(version, wait), timeout=wait + 5))
        except ray.exceptions.RayActorError:
            return "trainer rank 0, which drives the engines (and holds the mailbox), died"
        except (ray.exceptions.RayError, TimeoutError) as exc:
            return f"version {version}: the trainer's mailbox did not answer ({exc})"

    def _release(self, version: int, deadline: float) -> str:
        """Waits until no engine worker can read this rank's tensors (each is freed
        once no handle of the version is alive anywhere), then lets them go."""
        try:
            for tensor in self._state.values():
                rd.wait_tensor_freed(_local(tensor), timeout=max(_left(deadline), 0.0))
        except TimeoutError:
            return (
                f"trainer rank {self.info.rank}: an engine worker still held version "
                f"{version}'s tensors at the deadline ({self.info.timeout:.0f} s, "
                "RaydirectTrainerInitInfo.timeout): they may still be read; do not write "
                "them in place before rd.wait_tensor_freed returns for them"
            )
        finally:
            self._state.clear()  # the publisher keeps this dict: emptied, not replaced
        return ""

    def shutdown(self) -> None:
        """Releases the published tensors and, on rank 0, the mailbox."""
        self._publisher, self._state = None, {}
        if self.is_sender and self.mailbox is not None:
            ray.kill(self.mailbox)
            self.mailbox = None


def _left(deadline: float) -> float:
    return deadline - time.monotonic()


def _joined(*errors: str) -> str:
    return " ".join(e for e in errors if e)
