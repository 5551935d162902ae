"""Workload 9's processes: a vLLM engine as a Ray actor, a trainer holding the
whole model, the ranks of a 2-rank FSDP2 trainer, and the functions the engine
runs inside its workers (``collective_rpc``, which takes a function only with
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``).

Imports vLLM: only ``rdbench.vllm_update`` imports this module, and only where
vLLM is installed (.venv-vllm: ``bash scripts/setup-vllm-venv.sh``); what the
two share is in ``rdbench.vllm_shared``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch
from safetensors.torch import load_file, save_file
from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

import raydirect as rd
from rdbench.vllm_shared import DELTA, MAX_MODEL_LEN, STREAM_PROMPT, STREAM_TOKENS

BENCHMARKS = str(Path(__file__).resolve().parents[1])  # rdbench's parent, for the workers
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0|1",  # a core per worker at tensor parallel 2
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc with the functions below
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",  # with the progress lines, not in the tables
}
STASH = "_rdbench_stash"  # the floor's tensors, kept on the worker between rounds
SHARE = "_rdbench_share"  # floor (c)'s bytes: the worker's share, copied before (b)


# ---------------------------------------------------------------- in the engine's workers


def _reload(worker: Any, tensors: dict[str, torch.Tensor]) -> None:
    """``load_weights`` under the layerwise reload, as vLLM's nccl engine runs it."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    model = worker.model_runner.get_model()
    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        initialize_layerwise_reload(model)
        model.load_weights(iter(tensors.items()))
        finalize_layerwise_reload(model, worker.vllm_config.model_config)


def reload_from_file(worker: Any, path: str) -> float:
    """(a): read the trainer's safetensors file and load it; seconds in the worker."""
    start = time.perf_counter()
    _reload(worker, load_file(path))
    return time.perf_counter() - start


def stash_file(worker: Any, path: str) -> int:
    """Before the floor's rounds, untimed: the file's tensors into the worker's memory."""
    tensors = load_file(path)
    setattr(worker, STASH, tensors)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def reload_stash(worker: Any) -> float:
    """(b), the floor: load tensors already in this process; seconds in the worker."""
    start = time.perf_counter()
    _reload(worker, getattr(worker, STASH))
    return time.perf_counter() - start


def stash_share(worker: Any, nbytes: int) -> int:
    """Before floor (c)'s rounds, untimed: a buffer of this worker's share of bytes."""
    setattr(worker, SHARE, torch.ones(nbytes, dtype=torch.uint8))
    return nbytes


def reload_stash_after_copy(worker: Any) -> float:
    """(c): one copy of this worker's share into fresh memory (page faults
    included: what receiving it costs at the least), then (b); seconds."""
    share = getattr(worker, SHARE)
    start = time.perf_counter()
    torch.empty_like(share).copy_(share)
    _reload(worker, getattr(worker, STASH))
    return time.perf_counter() - start


def drop_stash(worker: Any) -> None:
    for name in (STASH, SHARE):
        if hasattr(worker, name):
            delattr(worker, name)


def samples(worker: Any) -> dict[str, Any]:
    """What the check compares: the final norm (whole on every worker) and the first
    rows of the embedding (this worker's slice of the vocabulary starts it). Not a
    linear layer's weight: on CPU vLLM repacks those for oneDNN after loading and
    leaves the parameter empty."""
    model = worker.model_runner.get_model()
    return {
        "rank": worker.rank,
        "norm": model.model.norm.weight.detach().clone(),
        "embed": model.model.embed_tokens.weight[:4].detach().clone(),
    }


def received(worker: Any) -> int:
    """This worker's bytes received through raydirect so far."""
    return sum(rd.local_stats().bytes_received.values())


# ---------------------------------------------------------------- actors


@dataclass
class _Stream:
    """One streaming request: each token's arrival (``time.monotonic()``, the
    clock every process of this machine shares), and when to end it."""

    times: list[float] = field(default_factory=list)
    stop_at: int | None = None  # end once this many tokens have arrived
    done: bool = False


@ray.remote(num_cpus=0)
class Engine:
    """A vLLM ``AsyncLLM`` in an async Ray actor, with the methods
    ``RayVLLMWeightSyncClient`` calls (coroutines: Ray runs them on the actor's
    event loop, so an update's calls arrive while ``stream`` serves a request),
    ``rpc`` for the functions above, and the streaming request the stall is
    measured on. The offline ``LLM`` would block the actor while it generates.
    Its workers are processes of its own: they inherit ``RAY_ADDRESS`` (the
    backend joins the cluster through it) and ``PYTHONPATH`` (to find this module)."""

    def __init__(self, model: str, backend: bool, **engine_kwargs: Any) -> None:
        os.environ.update(VLLM_ENV)
        os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
        path = os.environ.get("PYTHONPATH", "")
        os.environ["PYTHONPATH"] = f"{BENCHMARKS}:{path}" if path else BENCHMARKS
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        transfer = {"weight_transfer_config": {"backend": "raydirect"}} if backend else {}
        args = AsyncEngineArgs(
            model=model,
            dtype="float32",
            skip_tokenizer_init=True,
            max_model_len=MAX_MODEL_LEN,
            enforce_eager=True,
            disable_log_stats=True,
            **transfer,
            **engine_kwargs,
        )
        self.llm = AsyncLLM.from_engine_args(args)
        self.streams: dict[str, _Stream] = {}

    async def init_weight_transfer_engine(self, request: Any) -> None:
        await self.llm.init_weight_transfer_engine(request)

    async def start_weight_update(self) -> None:
        await self.llm.start_weight_update()

    async def update_weights(self, request: Any) -> None:
        await self.llm.update_weights(request)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self.llm.finish_weight_update(weight_version)

    async def update_weight_version(self, new_version: str) -> None:
        await self.llm.update_weight_version(new_version)

    async def rpc(self, fn: Any, *args: Any) -> list[Any]:
        return await self.llm.collective_rpc(fn, args=args)

    async def stream(self, sid: str) -> list[float]:
        """Serves one greedy request (its end token ignored) until ``end_stream``;
        returns when each of its tokens arrived here, where a client would see it."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=STREAM_TOKENS,
            temperature=0.0,
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,  # each output: the tokens new since the last
        )
        # the streams before this one are over, and the driver asks nothing more of them
        self.streams = {k: v for k, v in self.streams.items() if not v.done}
        state = self.streams.setdefault(sid, _Stream())
        outputs = self.llm.generate({"prompt_token_ids": STREAM_PROMPT}, params, sid)
        try:
            async with contextlib.aclosing(outputs):  # leaving early aborts the request
                async for out in outputs:
                    now = time.monotonic()
                    state.times += [now] * len(out.outputs[0].token_ids)
                    if state.stop_at is not None and len(state.times) >= state.stop_at:
                        break
        finally:
            state.done = True
        return state.times

    async def wait_tokens(self, sid: str, count: int) -> int:
        """Returns once ``sid`` has ``count`` tokens (or has ended: its ``stream``
        call then says why); Ray may start this before ``stream``."""
        state = self.streams.setdefault(sid, _Stream())
        while len(state.times) < count and not state.done:
            await asyncio.sleep(0.005)
        return len(state.times)

    async def end_stream(self, sid: str, more: int) -> None:
        """Ends ``sid`` once ``more`` tokens have arrived after this call."""
        state = self.streams.get(sid)
        if state is not None:
            state.stop_at = len(state.times) + more


class _Sender:
    """What both trainers share: send engines by name, the delta step, stats."""

    model: Any
    rank = 0

    def __init__(self) -> None:
        self.senders: dict[str, Any] = {}

    def step(self) -> None:
        """Untimed, before a send: every parameter moves by ``DELTA`` (in place)."""
        with torch.no_grad():
            for p in self.model.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                local.add_(DELTA)

    def send(self, name: str) -> float:
        start = time.perf_counter()
        self.senders[name].send_weights()
        return time.perf_counter() - start

    def bytes_sent(self) -> int:
        return sum(rd.local_stats().bytes_sent.values())

    def _connect(self, engines: list[Any], name: str, source: Any) -> None:
        from raydirect.vllm import RaydirectTrainerInitInfo

        info = RaydirectTrainerInitInfo(rank=self.rank, name=name)
        client = RayVLLMWeightSyncClient(engines)
        self.senders[name] = WeightTransferTrainerFactory.trainer_init(
            info, client=client, source=source
        )


def _load_llama(path: str) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@ray.remote(num_cpus=0)
class Trainer(_Sender):
    """One process holding the whole model (``ModuleSource``)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        torch.set_grad_enabled(False)
        self.model = _load_llama(path)

    def connect(self, engines: list[Any], name: str) -> None:
        self._connect(engines, name, ModuleSource(self.model))

    def save(self, path: str) -> float:
        """(a)'s trainer half: the full state dict as one safetensors file."""
        start = time.perf_counter()
        save_file({k: v.contiguous() for k, v in self.model.state_dict().items()}, path)
        return time.perf_counter() - start


@ray.remote(num_cpus=0)
class FsdpRank(_Sender):
    """One rank of a 2-rank FSDP2 trainer on gloo: every decoder layer and the
    whole model ``fully_shard``-ed over the ranks (parameters are DTensors, each
    rank holding its rows)."""

    def __init__(self, path: str, rank: int, world: int, address: str) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        super().__init__()
        self.rank = rank
        dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        self.model = _load_llama(path)
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def connect(self, engines: list[Any], name: str, sharded: bool) -> None:
        from raydirect.vllm import ShardedModuleSource

        source = ShardedModuleSource(self.model) if sharded else ModuleSource(self.model)
        self._connect(engines, name, source)
