"""The worker side: each vLLM worker pulls its part of a version, then loads it.

``update_weights({"version": v, ...})`` runs in every worker of the engine. It
takes the trainer ranks' handles of ``v`` from their mailbox (a named Ray actor;
the update info itself is plain JSON, so it passes vLLM's RPC and HTTP), receives
every byte this worker needs into memory of its own with ``rd.WeightSubscriber``,
and only then loads them through vLLM's layerwise reload
(``initialize_layerwise_reload`` / ``model.load_weights`` /
``finalize_layerwise_reload``), so fused and quantized layouts come out as vLLM
makes them. Layers whose loaders only slice and concatenate (see ``landing``)
received their bytes already laid out as the loaders would have written them:
vLLM processes those tensors directly, with no loader copy. An update that fails
before the load leaves the model untouched: the engine serves the weights it had.

On CPU vLLM's workers are plain subprocesses of the engine, not Ray actors: the
engine joins the trainer's Ray cluster itself, at ``init_transfer_engine``. Under
vLLM's Ray executor (GPU) the worker is a Ray actor and uses its own connection.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, cast

import ray
import torch
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)
from vllm.model_executor.model_loader.reload.layerwise import (
    _layerwise_process,
    get_layerwise_info,
)

import raydirect as rd
from raydirect.vllm.landing import survey, unread_problems
from raydirect.vllm.staging import Receiver

log = logging.getLogger(__name__)
_SHOWN = 5  # refusals listed in one error


@dataclass
class RaydirectInitInfo(WeightTransferInitInfo):
    """What trainer rank 0 sends each engine once: where its mailbox is."""

    name: str
    namespace: str
    address: str
    timeout: float = 300.0


@dataclass
class RaydirectUpdateInfo(WeightTransferUpdateInfo):
    """One update: the version, how many trainer ranks published it, and its
    tensors' names, dtypes and global shapes (as vLLM's nccl backend sends them)."""

    version: int
    ranks: int
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


def _join_ray(info: RaydirectInitInfo) -> None:
    if ray.is_initialized():
        return  # a Ray actor already (vLLM's Ray executor)
    ray.init(
        address=info.address,
        namespace=info.namespace,
        logging_level=logging.WARNING,
        log_to_driver=False,
    )


def _tensor_parallel() -> tuple[int, int]:
    try:
        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except AssertionError:  # no parallel state: a model outside an engine
        return 0, 1


def load(model: torch.nn.Module, model_config: Any, receiver: Receiver) -> bool:
    """Loads what ``receiver`` received through vLLM's own reload path, as its
    nccl and ipc engines run it, landed layers first; False when the model kept
    some of the receiver's memory, which must then not be received into again."""
    reusable = True
    initialize_layerwise_reload(model)
    try:
        for layer_name, tensors in receiver.landed.items():
            if _process_landed(model.get_submodule(layer_name), tensors):
                reusable = False
        cast(Any, model).load_weights(receiver.weights())
    finally:
        finalize_layerwise_reload(model, model_config)
    for layer_name in receiver.retie:  # a tied head: processed again from its new values
        layer = model.get_submodule(layer_name)
        method = getattr(layer, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(layer)
    return reusable


def _process_landed(layer: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> bool:
    """What vLLM's reload does with a layer once its loaders have run
    (``_layerwise_process``: process, copy into the serving tensors), given the
    layer's tensors as the loaders would have left them. True when the processed
    layer still holds one of them, which must then not be refilled."""
    for name, memory in tensors.items():
        stand = getattr(layer, name)  # the reload's meta stand-in: its class, its loader
        tensor = memory.view(memory.shape)
        tensor.__class__ = stand.__class__
        tensor.__dict__ = stand.__dict__.copy()
        setattr(layer, name, tensor)
    _layerwise_process(layer, get_layerwise_info(layer))
    ours = {t.untyped_storage().data_ptr() for t in tensors.values()}
    held = [*layer.parameters(recurse=False), *layer.buffers(recurse=False), *vars(layer).values()]
    return any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in ours for t in held)


class RaydirectWeightTransferEngine(WeightTransferEngine[RaydirectInitInfo, RaydirectUpdateInfo]):
    """The worker-side engine of the ``raydirect`` backend (see the module docstring)."""

    init_info_cls = RaydirectInitInfo
    update_info_cls = RaydirectUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._mailbox: Any = None
        self._timeout = 300.0
        self._receivers: dict[tuple[Any, ...], Receiver] = {}
        self.last_update: dict[str, Any] = {}  # seconds per phase, bytes received

    def init_transfer_engine(self, init_info: RaydirectInitInfo) -> None:
        _join_ray(init_info)
        try:
            self._mailbox = ray.get_actor(init_info.name, namespace=init_info.namespace)
        except ValueError:
            raise rd.WeightSyncError(
                f"raydirect: no trainer mailbox {init_info.name!r} in Ray namespace "
                f"{init_info.namespace!r} at {init_info.address}: is the trainer's "
                "trainer_init running?"
            ) from None
        self._timeout = float(init_info.timeout)
        self._receivers.clear()

    def start_weight_update(self) -> None:
        """Nothing yet: the model is touched only once every byte has arrived."""

    def finish_weight_update(self) -> None:
        """Nothing left: ``update_weights`` applied the version whole."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def receive_weights(self, update_info: RaydirectUpdateInfo) -> None:
        if self._mailbox is None:
            raise rd.WeightSyncError(
                "raydirect: init_weight_transfer_engine was not called on this engine"
            )
        start = time.perf_counter()
        handles = self._handles(update_info.version)
        receiver = self._receiver_for(update_info)
        planned = time.perf_counter()
        try:
            self._receive(update_info.version, receiver, handles)
        except rd.WeightSyncError as exc:
            raise rd.WeightSyncError(
                f"raydirect: version {update_info.version} did not arrive ({exc}); the model "
                "is untouched"
            ) from exc
        received = time.perf_counter()
        self._load(receiver)
        self.last_update = {
            **self.last_update,
            "version": update_info.version,
            "plan_s": planned - start,
            "receive_s": received - planned,
            "load_s": time.perf_counter() - received,
            "bytes": receiver.bytes,
            "landed_bytes": receiver.landed_bytes,
        }
        log.info("raydirect: applied version %s %s", update_info.version, self.last_update)

    def _receive(self, version: int, receiver: Receiver, handles: list[Any]) -> None:
        """From the ranks, or from the worker of another engine on this node that
        reads the same and received it first (the relay): across nodes the
        trainer then sends each byte once per node, not once per engine."""
        key = f"{ray.get_runtime_context().get_node_id()} {receiver.key}"
        if ray.get(self._mailbox.lead.remote(version, key)):
            try:
                receiver.receive(handles, self._timeout)
            except BaseException:
                self._mailbox.relayed.remote(version, key, [""])
                raise
            self._mailbox.relayed.remote(version, key, [receiver.relay(version)])
            self.last_update["relayed_from"] = 0
            return
        relay = ray.get(self._mailbox.relay.remote(version, key, self._timeout))
        if relay is not None:
            try:
                receiver.receive([relay], self._timeout)
                self.last_update["relayed_from"] = 1
                return
            except rd.WeightSyncError as exc:  # the relay's worker went: the ranks
                log.warning("raydirect: relay of version %s failed (%s)", version, exc)
        receiver.receive(handles, self._timeout)
        self.last_update["relayed_from"] = 0

    def _handles(self, version: int) -> list[Any]:
        try:
            return ray.get(self._mailbox.take.remote(version, self._timeout))
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if exc.cause is not None else exc
            raise rd.WeightSyncError(f"raydirect: {cause}; the model is untouched") from None
        except ray.exceptions.RayActorError:
            raise rd.WeightSyncError(
                "raydirect: the trainer's mailbox is gone: trainer rank 0 died; the model "
                "is untouched"
            ) from None

    def _receiver_for(self, update: RaydirectUpdateInfo) -> Receiver:
        key = (tuple(update.names), tuple(update.dtype_names), tuple(map(tuple, update.shapes)))
        receiver = self._receivers.get(key)
        if receiver is None:
            published = [
                (n, getattr(torch, d), tuple(s))
                for n, d, s in zip(update.names, update.dtype_names, update.shapes, strict=True)
            ]
            plan = survey(self.model, published)
            problems = plan.problems
            if _tensor_parallel()[1] == 1:  # with more ranks it takes all their reads
                shapes = {name: shape for name, _dtype, shape in published}
                problems = problems + unread_problems(shapes, [plan.reads])
            if problems:
                shown = "; ".join(problems[:_SHOWN])
                more = len(problems) - _SHOWN
                raise rd.WeightSyncError(
                    f"raydirect: version {update.version} does not fit the engine's model: "
                    f"{shown}{f' (and {more} more)' if more > 0 else ''}; the model is untouched"
                )
            receiver = Receiver(published, plan)
            self._receivers = {key: receiver}  # one layout at a time is what a loop sends
        return receiver

    def _load(self, receiver: Receiver) -> None:
        if not load(self.model, self.model_config, receiver):
            self._receivers.clear()  # the model holds its memory: the next update allocates anew

    def shutdown(self) -> None:
        self._receivers.clear()
        self._mailbox = None
