"""benchmarks/gpu.py's actors and checks: a producer and a consumer of CUDA
tensors for raydirect (and Ray's object store) and for Ray's RDT, on one GPU."""

from __future__ import annotations

import math
import time
from typing import Any

import ray
import torch

import raydirect as rd
from rdbench.common import DTYPE, ELEMENT_BYTES, MIB, Layout, fill_layout, layout_bytes, part_seed

GPU_SHARE = 0.25  # four actors (two producers, two consumers) on the one GPU
CHECK_CHUNK = 64 * MIB  # elements compared per step (a 256 MiB expected tensor)
TIMEOUT_S = 300.0  # one transfer, one setup call
FREE_TIMEOUT_S = 60.0


# ---------------------------------------------------------------- checks


def check_cuda(tensor: Any, seed: int, nbytes: int) -> None:
    """Raise ValueError unless ``tensor`` is a CUDA int32 tensor holding
    ``i + seed`` at element ``i``, every element compared."""
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != DTYPE:
        raise ValueError(f"expected a {DTYPE} tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cuda":
        raise ValueError(f"expected a CUDA tensor, got one on {tensor.device}")
    flat = tensor.reshape(-1)
    n = flat.numel()
    if n * ELEMENT_BYTES != nbytes:
        raise ValueError(f"expected {nbytes} bytes, got {n * ELEMENT_BYTES}")
    for start in range(0, n, CHECK_CHUNK):
        part = flat[start : start + CHECK_CHUNK]
        want = torch.arange(
            seed + start, seed + start + part.numel(), dtype=DTYPE, device=flat.device
        )
        if not torch.equal(part, want):
            i = start + int((part != want).nonzero()[0])
            raise ValueError(
                f"wrong contents: element {i} is {int(flat[i])}, expected {i + seed} (seed {seed})"
            )


def check_state(tensors: dict[str, torch.Tensor], layout: Layout, seed: int) -> int:
    for k, (name, shape) in enumerate(layout.items()):
        try:
            check_cuda(tensors[name], part_seed(seed, k), math.prod(shape) * ELEMENT_BYTES)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    return layout_bytes(layout)


# ---------------------------------------------------------------- actors


class GpuSource:
    """Producer: named int32 CUDA tensors, rewritten in place before every transfer
    (outside the timed region, after no earlier object holds them)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.publisher: Any = None

    def allocate(self, layout: Layout) -> int:
        self.tensors, self.publisher = {}, None  # the previous ones go first
        self.tensors = {n: torch.empty(s, dtype=DTYPE, device="cuda") for n, s in layout.items()}
        fill_layout(self.tensors, 0)
        torch.cuda.synchronize()
        return layout_bytes(layout)

    def wait_free(self, tensor: torch.Tensor) -> None:
        """Block until no earlier object still holds ``tensor``."""

    def prepare(self, seed: int) -> None:
        for tensor in self.tensors.values():
            self.wait_free(tensor)
        fill_layout(self.tensors, seed)
        torch.cuda.synchronize()

    def device_name(self) -> str:
        return torch.cuda.get_device_name()


class _RdSource(GpuSource):
    """raydirect (``one_<transport>``, ``publish``) and plain Ray methods (``one``,
    ``state``: the value goes through Ray's object store)."""

    def wait_free(self, tensor: torch.Tensor) -> None:
        rd.wait_tensor_freed(tensor, timeout=FREE_TIMEOUT_S)

    @rd.method(tensor_transport="cuda_ipc")
    def one_cuda_ipc(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    @rd.method(tensor_transport="auto")
    def one_auto(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    @rd.method(tensor_transport="nixl")
    def one_nixl(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def one(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def state(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    def publish(self) -> rd.WeightsHandle:
        if self.publisher is None:
            self.publisher = rd.WeightPublisher(self.tensors)
        return self.publisher.publish((self.publisher.version or 0) + 1, timeout=TIMEOUT_S)


class _RdtSource(GpuSource):
    """Ray's RDT: plain methods called with ``.options(tensor_transport=...)``."""

    def wait_free(self, tensor: torch.Tensor) -> None:
        from ray.experimental import wait_tensor_freed

        wait_tensor_freed(tensor, timeout=FREE_TIMEOUT_S)

    def one(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def state(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)


class GpuSink:
    """Consumer: receives, synchronizes, keeps the value for an untimed check."""

    def __init__(self) -> None:
        self.last: Any = None
        self.layout: Layout = {}
        self.targets: dict[str, torch.Tensor] = {}
        self.subscriber: Any = None

    def receive(self, how: str, box: list[Any]) -> float:
        """Read ``box[0]`` (``rd.get``, ``ray.get`` for RDT, or the object store's
        ``ray.get`` then ``.cuda()``); returns the seconds until it is on the GPU."""
        start = time.perf_counter()
        if how == "rd.get":
            value = rd.get(box[0], timeout=TIMEOUT_S)
        else:
            value = ray.get(box[0], timeout=TIMEOUT_S)
            if how == "object store":
                value = value.cuda()
        torch.cuda.synchronize()
        self.last = value
        return time.perf_counter() - start

    def receive_value(self, value: Any) -> None:
        """Ray's RDT: its ref was a direct task argument (RDT cannot resolve a ref
        handed over inside a container: "Tensor transport metadata is not
        available ... at the time of borrowing"), so Ray moved the tensor before
        this method ran; here it only waits for the GPU and keeps the value."""
        torch.cuda.synchronize()
        self.last = value

    def check_last(self, seed: int, nbytes: int) -> int:
        value, self.last = self.last, None
        check_cuda(value, seed, nbytes)
        return nbytes

    def set_layout(self, layout: Layout) -> None:
        self.layout, self.subscriber, self.targets = layout, None, {}
        self.targets = {n: torch.zeros(s, dtype=DTYPE, device="cuda") for n, s in layout.items()}

    def load_weights(self, handle: Any) -> None:
        """raydirect: rd.WeightSubscriber into this consumer's own CUDA tensors."""
        if self.subscriber is None:
            self.subscriber = rd.WeightSubscriber(self.targets)
        self.subscriber.load(handle, timeout=TIMEOUT_S)
        torch.cuda.synchronize()

    def copy_state(self, state: dict[str, torch.Tensor]) -> None:
        """By hand (object store, RDT): the dict arrived as a task argument; copy each
        tensor into this consumer's own, as ``load_state_dict`` does."""
        for name, target in self.targets.items():
            target.copy_(state[name].cuda())
        torch.cuda.synchronize()

    def check_targets(self, seed: int) -> int:
        return check_state(self.targets, self.layout, seed)


RdSource: Any = ray.remote(num_cpus=0, num_gpus=GPU_SHARE)(_RdSource)
RdSink: Any = ray.remote(num_cpus=0, num_gpus=GPU_SHARE)(GpuSink)
# RDT receives on a system concurrency group Ray adds only with enable_tensor_transport
# on the class (benchmarks/rdbench/actors.py says what happens without it).
RdtSource: Any = ray.remote(num_cpus=0, num_gpus=GPU_SHARE, enable_tensor_transport=True)(
    _RdtSource
)
RdtSink: Any = ray.remote(num_cpus=0, num_gpus=GPU_SHARE, enable_tensor_transport=True)(GpuSink)
