"""raydirect on a CUDA GPU: cuda_ipc, auto, device=, into=, lifetime, faults, weight
sync, NIXL on device memory and NCCL. Skipped, with the reason, where no GPU is.

One GPU is shared by every actor here: each takes a quarter of it (``GPU_SHARE``),
so the module's pair and the two actors a test adds fit on it together. Run on a
GPU machine with ``./dev gpu WHEELS_DIR`` (docs/gpu.md).
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import time
import warnings
from typing import Any

import pytest
import ray
import torch
from ray import cloudpickle

import raydirect as rd
from raydirect._producer import inline_limit
from raydirect.testing import mismatch
from raydirect.transports import nixl_agent

from helpers import wait_for

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none"
)

# Workers cannot import the tests directory: ship this module's actor and helpers by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

MiB = 1 << 20
GiB = 1 << 30
GPU_SHARE = 0.25  # four actors at most on the one GPU at a time
TIMEOUT = 120.0  # one read or call; a hang fails the test instead of the run
# Cases that take tens of seconds run only with RAYDIRECT_GPU_SLOW=1 (`./dev gpu --slow`):
# one device call of the workplace's GPU machine must fit tests, benchmark and install.
slow = pytest.mark.skipif(
    os.environ.get("RAYDIRECT_GPU_SLOW") != "1",
    reason="slow: set RAYDIRECT_GPU_SLOW=1 (./dev gpu WHEELS_DIR --slow) to run it",
)
DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
)
CASES = ("dtypes", "views", "many", "aliasing")


# ---------------------------------------------------------------- values


def _of_dtype(base: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype is torch.bool:
        return base > 0
    if dtype.is_complex:
        return torch.complex(base, -base).to(dtype)
    if dtype.is_floating_point:
        return base.to(dtype)
    scaled = base * 50
    return (scaled.abs() if dtype is torch.uint8 else scaled).to(dtype)


def make_value(case: str, device: str = "cuda") -> Any:
    """A deterministic value on ``device``: made on the CPU, then moved, so every
    process builds the same bytes; views are taken on ``device`` itself."""
    g = torch.Generator().manual_seed(11)
    base = torch.randn(64, 32, generator=g)
    if case == "dtypes":
        value = {str(d).removeprefix("torch."): _of_dtype(base, d).to(device) for d in DTYPES}
        value["zero_d"] = torch.tensor(3.5, device=device)
        value["empty"] = torch.empty(0, 5, device=device)
        return value
    if case == "views":
        on = base.to(device)
        storage = torch.arange(4096, dtype=torch.float32).to(device)
        return {
            "transposed": on.t(),  # non-contiguous
            "strided": on[::3, 1::2],  # non-contiguous, storage offset
            "row": on[7],  # contiguous, storage offset
            "slice_of_big": storage[100:140],  # 40 elements of a 4096-element storage
            "block": storage.view(64, 64)[5:9, 10:50],  # non-contiguous, offset
            "expanded": torch.ones(3, 1, device=device).expand(3, 4),  # stride 0
        }
    if case == "many":  # 100 tensors of several sizes and dtypes, nested in lists and dicts
        layers = [
            {
                "w": torch.full((i % 7 + 1, 33), float(i)).to(device),
                "b": torch.arange(i + 1, dtype=torch.int64).to(device),
            }
            for i in range(50)
        ]
        return {"layers": layers, "config": {"step": 3, "name": "many"}}
    if case == "aliasing":
        t = base.to(device).clone()
        return {"a": t, "b": t, "nested": [t, (t, {"deep": t})], "other": t + 1}
    raise ValueError(case)


def tensors_of(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_of(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_of(v)]
    return []


def check(case: str, got: Any, device: str = "cuda") -> str | None:
    """None when ``got`` is ``case``'s value, exactly, with every tensor on ``device``."""
    kind = torch.device(device).type
    wrong = sorted({str(t.device) for t in tensors_of(got) if t.device.type != kind})
    if wrong:  # checked first: comparing tensors on two devices raises
        return f"tensors arrived on {wrong}, expected {device}"
    problem = mismatch(got, make_value(case, device))
    if problem is None and case == "aliasing":
        one = got["a"]
        if not (one is got["b"] is got["nested"][0] is got["nested"][1][1]["deep"]):
            problem = "the same tensor arrived as several tensors"
    return problem


def make_model(seed: int, device: str = "cuda") -> torch.nn.Module:
    """A small model on ``device`` (or "mixed": its first layer on the GPU, the rest
    in host memory): float32 and bfloat16 parameters and an int64 buffer."""
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.LayerNorm(256), torch.nn.Linear(256, 64)
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    model[2].to(torch.bfloat16)
    model.register_buffer("steps", torch.zeros((), dtype=torch.int64))
    if device == "mixed":
        model[0].cuda()
        return model
    return model.to(device)


class TensorParallel:
    """``shard`` for rank ``rank`` of ``world`` over ``make_model``'s tensors: the
    first layer column-parallel (rows: one run each), the last layer's weight
    row-parallel (columns: short strided runs), the rest replicated."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def __call__(self, name: str, full_shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        dim = 0 if name.startswith("0.") else 1 if name == "2.weight" else None
        if dim is None or self.world == 1:
            return None
        part = full_shape[dim] // self.world
        return (dim, self.rank * part, (self.rank + 1) * part)

    def take(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        spec = self(name, tuple(tensor.shape))
        return tensor if spec is None else tensor.narrow(spec[0], spec[1], spec[2] - spec[1])


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------- the actor


@ray.remote(num_cpus=0, num_gpus=GPU_SHARE)
class Peer:
    """Producer and reader in one class; the tests pick which role each plays."""

    def __init__(self) -> None:
        self.kept: dict[str, torch.Tensor] = {}
        self.warnings: list[str] = []
        self.reads: dict[str, Any] = {}

    def pid(self) -> int:
        return os.getpid()

    def sees_gpu(self) -> bool:
        return torch.cuda.is_available()

    def stats(self) -> rd.LocalStats:
        return rd.local_stats()

    def memory(self) -> int:
        """CUDA memory this process has allocated (tensors alive), after a collection."""
        gc.collect()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    # -- producing
    def put(self, case: str, transport: str = "auto", device: str = "cuda") -> list:
        # Wrapped in a list so the caller receives the ref itself, not its value.
        return [rd.put(make_value(case, device), transport)]

    @rd.method
    def value(self, case: str) -> Any:
        return make_value(case)

    @rd.method
    def sized(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), 3, dtype=torch.uint8, device="cuda")  # not kept here

    @rd.method(reads=1)
    def sized_once(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), 3, dtype=torch.uint8, device="cuda")

    @rd.method(tensor_transport="nixl")
    def sized_nixl(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), 3, dtype=torch.uint8, device="cuda")

    @rd.method
    def arange(self, numel: int) -> torch.Tensor:
        return torch.arange(numel, dtype=torch.int32, device="cuda")

    @rd.method
    def keep(self, key: str, numel: int = 1 << 20) -> torch.Tensor:
        self.kept[key] = torch.arange(numel, dtype=torch.float32, device="cuda")
        return self.kept[key]

    def write_in_place(self, key: str) -> None:
        self.kept[key].add_(1)
        torch.cuda.synchronize()

    def wait_freed(self, key: str, timeout: float) -> str:
        try:
            rd.wait_tensor_freed(self.kept[key], timeout=timeout)
            return "freed"
        except TimeoutError as exc:
            return f"timeout: {exc}"

    def record_warnings(self) -> None:
        warnings.simplefilter("always")

        def hook(message, category, *args, **kwargs):
            self.warnings.append(f"{category.__name__}: {message}")

        warnings.showwarning = hook

    def recorded_warnings(self) -> list[str]:
        return list(self.warnings)

    def slow_put(self, numel: int, cycles: int) -> tuple[list, bool]:
        """A tensor whose last write is still queued behind a long kernel on this
        process's stream when it is exported; and whether the stream was idle then."""
        t = torch.zeros(numel, dtype=torch.int32, device="cuda")
        torch.cuda._sleep(cycles)
        t.fill_(7)
        ref = rd.put(t, "cuda_ipc")
        return [ref], torch.cuda.current_stream().query()

    # -- reading
    def read(self, case: str, refs: list, want: str = "cuda", **options: Any) -> dict:
        """``rd.get(refs[0], **options)``: what arrived, and over which transports."""
        before = dict(rd.local_stats().objects_received)
        got = rd.get(refs[0], timeout=TIMEOUT, **options)
        return {
            "problem": check(case, got, want),
            "received": _delta(before, rd.local_stats().objects_received),
        }

    def read_arg(self, case: str, value: Any) -> str | None:
        """The value Ray (and raydirect's rebuild) resolved as a task argument."""
        return check(case, value)

    def read_with_target(self, case: str, refs: list, want: str, **target: Any) -> dict:
        """``rd.set_target(ref, ...)``, then the read Ray makes (``ray.get``)."""
        rd.set_target(refs[0], **target)
        got = ray.get(refs[0], timeout=TIMEOUT)
        return {"problem": check(case, got, want)}

    def read_into(self, case: str, refs: list, how: str = "rd.get") -> dict:
        """Receive into this actor's own CUDA tensors, shaped like the value's."""
        want = make_value(case)
        targets = {k: torch.empty(v.shape, dtype=v.dtype, device="cuda") for k, v in want.items()}
        pointers = {k: t.data_ptr() for k, t in targets.items()}
        if how == "rd.get":
            got = rd.get(refs[0], into=targets, timeout=TIMEOUT)
        else:
            rd.set_target(refs[0], into=targets)
            got = ray.get(refs[0], timeout=TIMEOUT)
        return {
            "problem": check(case, got),
            "targets_returned": all(got[k] is targets[k] for k in targets),
            "same_memory": all(got[k].data_ptr() == pointers[k] for k in targets),
        }

    def try_read(self, refs: list, **options: Any) -> str:
        try:
            rd.get(refs[0], timeout=TIMEOUT, **options)
        except Exception as exc:
            return _error(exc) + (" [RaydirectError]" if isinstance(exc, rd.RaydirectError) else "")
        return "ok"

    def timed_read(self, refs: list) -> float:
        """Seconds for one ``rd.get`` of ``refs[0]``, checked after the timing."""
        start = time.perf_counter()
        got = rd.get(refs[0], timeout=TIMEOUT)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        assert bool((got == 3).all())
        return seconds

    def read_all_sevens(self, refs: list) -> bool:
        got = rd.get(refs[0], timeout=TIMEOUT)
        return bool((got == 7).all())

    def hold(self, refs: list) -> None:
        self.held = refs  # nested: this actor borrows the ref, another owns it

    def read_held(self) -> str:
        """ "ok" when the held ref reads as ``sized``'s threes, else what went wrong."""
        try:
            got = rd.get(self.held[0], timeout=TIMEOUT)
        except Exception as exc:
            return _error(exc)
        return "ok" if bool((got == 3).all()) else "wrong bytes"

    def occupy(self, nbytes: int, count: int) -> None:
        """Keep ``count`` tensors of sevens of ``nbytes`` each (in memory freed before)."""
        for i in range(count):
            self.kept[f"occupy{i}"] = torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()

    def read_and_measure(self, refs: list) -> dict:
        """CUDA memory while the received tensor is alive, and after it is dropped."""
        got = rd.get(refs[0], timeout=TIMEOUT)
        while_held = self.memory()
        ok = bool((got == 3).all())
        del got
        return {"ok": ok, "while_held": while_held, "after": self.memory()}

    def start_reading(self, refs: list, numel: int) -> None:
        """Read ``refs[0]`` (``arange(numel)``, int32) into one CUDA tensor again and
        again on a thread of its own, checking each read, until a read fails."""
        self.reads = {"ok": 0, "bad": 0, "error": None}
        target = torch.empty(numel, dtype=torch.int32, device="cuda")
        expected_sum = numel * (numel - 1) // 2

        def loop() -> None:
            while True:
                try:
                    got = rd.get(refs[0], into=target, timeout=60)
                    good = (
                        got is target
                        and int(target[-1]) == numel - 1
                        and int(target.sum(dtype=torch.int64)) == expected_sum
                    )
                except Exception as exc:
                    self.reads["error"] = _error(exc)
                    return
                self.reads["ok" if good else "bad"] += 1

        threading.Thread(target=loop, name="reader", daemon=True).start()

    def reading(self) -> dict:
        return dict(self.reads)

    # -- weight sync
    def make_source(self, seed: int, device: str = "cuda") -> None:
        self.source = make_model(seed, device)
        self.publisher = rd.WeightPublisher(self.source)

    def publish(self, version: int) -> rd.WeightsHandle:
        return self.publisher.publish(version, timeout=TIMEOUT)

    def step(self) -> None:
        with torch.no_grad():
            for p in self.source.parameters():
                p.add_(0.5)
            self.source.steps += 1

    def source_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.source.state_dict().items()}

    def make_target(self, seed: int, device: str = "cuda", world: int = 1) -> None:
        """A model on ``device`` to load into; with ``world`` > 1, a dict holding
        the last rank's tensor-parallel shard of it (``TensorParallel``)."""
        model = make_model(seed, device)
        shard = TensorParallel(world - 1, world)
        self.target: Any = model
        if world > 1:
            self.target = {
                k: torch.empty_like(shard.take(k, v), memory_format=torch.contiguous_format)
                for k, v in model.state_dict().items()
            }
        self.identity = {k: (id(v), v.data_ptr()) for k, v in self._target_state().items()}
        self.subscriber = rd.WeightSubscriber(self.target, shard=shard if world > 1 else None)

    def _target_state(self) -> dict[str, torch.Tensor]:
        if isinstance(self.target, torch.nn.Module):
            return self.target.state_dict(keep_vars=True)
        return self.target

    def load(self, handle: rd.WeightsHandle) -> dict:
        before = dict(rd.local_stats().objects_received)
        version = self.subscriber.load(handle, timeout=TIMEOUT)
        state = self._target_state()
        return {
            "version": version,
            "same_tensors": {k: (id(v), v.data_ptr()) for k, v in state.items()} == self.identity,
            "state": {k: v.detach().cpu() for k, v in state.items()},
            "devices": {k: v.device.type for k, v in state.items()},
            "received": _delta(before, rd.local_stats().objects_received),
        }

    def try_load(self, handle: rd.WeightsHandle) -> dict:
        """A load that may be refused: its error, and the bytes that moved."""
        before = sum(rd.local_stats().bytes_received.values())
        try:
            self.subscriber.load(handle, timeout=TIMEOUT)
            error = None
        except Exception as exc:
            error = _error(exc)
        return {
            "error": error,
            "received": sum(rd.local_stats().bytes_received.values()) - before,
            "version": self.subscriber.version,
        }


def _kill(*actors: Any) -> None:
    for actor in actors:
        ray.kill(actor)


# ---------------------------------------------------------------- NCCL (first: whole GPUs)


# Runs before the module's pair takes its share of GPU 0, so that on a machine of
# two GPUs both are free for the two ranks.
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL refuses two ranks on one device")
def test_nccl_between_two_gpus(ray_session):
    if ray.available_resources().get("GPU", 0) < 2:
        pytest.skip("needs two whole free GPUs in Ray for the two NCCL ranks")
    a, b = Peer.options(num_gpus=1).remote(), Peer.options(num_gpus=1).remote()
    name = rd.create_collective_group([a, b], backend="nccl")
    try:
        for case in ("dtypes", "views"):
            [ref] = ray.get(a.put.remote(case, "nccl"))
            result = ray.get(b.read.remote(case, [ref]), timeout=TIMEOUT)
            assert result == {"problem": None, "received": {"nccl": 1}}, result
    finally:
        rd.destroy_collective_group(name)
        _kill(a, b)


# ---------------------------------------------------------------- cuda_ipc and auto


def _alive(*actors: Any) -> bool:
    try:
        return ray.get([a.sees_gpu.remote() for a in actors], timeout=30) == [True] * len(actors)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False


@pytest.fixture(scope="module")
def _module_pair(ray_session):
    pair: list[Any] = []
    yield pair
    _kill(*pair)


@pytest.fixture
def gpu_pair(_module_pair):
    """A producer and a reader on the one GPU, shared by the module's tests; made
    again when a test left either dead (one crashed reader must not fail the rest)."""
    if not _module_pair or not _alive(*_module_pair):
        _kill(*_module_pair)
        _module_pair[:] = [Peer.remote(), Peer.remote()]
        assert _alive(*_module_pair), "the pair does not see the GPU"
    p, r = _module_pair
    return p, r


@pytest.mark.parametrize("transport", ["cuda_ipc", "auto"])
@pytest.mark.parametrize("case", CASES)
def test_values_round_trip_exactly(gpu_pair, case, transport):
    """Every dtype torch has on CUDA, views and non-contiguous tensors, 100 tensors
    in one value, one tensor under several names; ``auto`` picks cuda_ipc."""
    p, r = gpu_pair
    [ref] = ray.get(p.put.remote(case, transport))
    result = ray.get(r.read.remote(case, [ref]), timeout=TIMEOUT)
    assert result == {"problem": None, "received": {"cuda_ipc": 1}}, result


def test_a_method_result_as_a_task_argument(gpu_pair):
    p, r = gpu_pair
    before = ray.get(r.stats.remote()).objects_received.get("cuda_ipc", 0)
    for case in CASES:
        assert ray.get(r.read_arg.remote(case, p.value.remote(case)), timeout=TIMEOUT) is None
    assert ray.get(r.stats.remote()).objects_received.get("cuda_ipc", 0) == before + len(CASES)


def test_the_driver_reads_cuda_tensors(gpu_pair):
    p, _ = gpu_pair
    ref = p.value.remote("dtypes")
    before = rd.local_stats().objects_received.get("cuda_ipc", 0)
    assert check("dtypes", rd.get(ref, timeout=TIMEOUT)) is None
    assert check("dtypes", ray.get(ref, timeout=TIMEOUT)) is None
    assert rd.local_stats().objects_received.get("cuda_ipc", 0) == before + 2


def test_queued_writes_finish_before_the_copy(gpu_pair):
    """The producer's last write is still queued behind a ~1 s kernel when the
    object is made; the reader must see it done, never the zeros before it."""
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("this torch has no torch.cuda._sleep to hold the producer's stream")
    p, r = gpu_pair
    refs, stream_idle = ray.get(p.slow_put.remote(16 * MiB, 2_000_000_000))
    assert stream_idle is False, (
        "the producer's stream was idle when the object was made: something synchronized, "
        "or the sleep was too short for this GPU"
    )
    assert ray.get(r.read_all_sevens.remote(refs), timeout=TIMEOUT) is True


# ---------------------------------------------------------------- into= and device=


@pytest.mark.parametrize("how", ["rd.get", "set_target"])
def test_into_preallocated_cuda_tensors(gpu_pair, how):
    p, r = gpu_pair
    [ref] = ray.get(p.put.remote("dtypes", "auto"))
    result = ray.get(r.read_into.remote("dtypes", [ref], how), timeout=TIMEOUT)
    assert result == {"problem": None, "targets_returned": True, "same_memory": True}, result


@pytest.mark.parametrize("case", ["dtypes", "views"])
def test_device_cpu_receives_a_cuda_producers_tensors_into_host_memory(gpu_pair, case):
    p, r = gpu_pair
    [ref] = ray.get(p.put.remote(case, "auto"))
    result = ray.get(r.read.remote(case, [ref], "cpu", device="cpu"), timeout=TIMEOUT)
    assert result == {"problem": None, "received": {"cuda_ipc": 1}}, result  # no staging copy
    [ref] = ray.get(p.put.remote(case, "auto"))
    result = ray.get(r.read_with_target.remote(case, [ref], "cpu", device="cpu"))
    assert result == {"problem": None}, result


def _cpu_bytes(case: str) -> int:
    """The bytes ``case``'s CPU tensors send: each distinct tensor's elements."""
    tensors = {id(t): t for t in tensors_of(make_value(case, "cpu"))}.values()
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("case", ["dtypes", "views"])
def test_device_cuda_receives_a_cpu_producers_tensors_onto_the_gpu(gpu_pair, case):
    """Over a CPU transport, then one copy onto the GPU; or, for a value under the
    inline limit (``auto``'s 64 KiB: ``views``, ~10 KB), with Ray's reply itself:
    no read to count (the H200 run expected one for ``views`` and saw none)."""
    inline = _cpu_bytes(case) <= inline_limit()
    p, r = gpu_pair
    [ref] = ray.get(p.put.remote(case, "auto", "cpu"))
    result = ray.get(r.read.remote(case, [ref], "cuda", device="cuda:0"), timeout=TIMEOUT)
    assert result["problem"] is None, result
    if inline:
        assert result["received"] == {}, result
    else:
        assert sum(result["received"].values()) == 1, result
        assert set(result["received"]) <= {"cma", "shm"}, result  # a CPU path, then one copy
    [ref] = ray.get(p.put.remote(case, "auto", "cpu"))
    result = ray.get(r.read_with_target.remote(case, [ref], "cuda", device="cuda:0"))
    assert result == {"problem": None}, result


def test_an_actor_without_gpus_reads_cuda_tensors_into_host_memory(gpu_pair):
    """Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone for num_gpus=0 actors
    (ray-project/ray#54868), so such an actor still sees the GPU and cuda_ipc copies
    straight into its host memory."""
    p, _ = gpu_pair
    c = Peer.options(num_gpus=0).remote()
    try:
        assert ray.get(c.sees_gpu.remote()) is True, (
            "this Ray hides the GPU from num_gpus=0 actors; the next test covers that case"
        )
        [ref] = ray.get(p.put.remote("dtypes", "auto"))
        result = ray.get(c.read.remote("dtypes", [ref], "cpu", device="cpu"), timeout=TIMEOUT)
        assert result == {"problem": None, "received": {"cuda_ipc": 1}}, result
    finally:
        _kill(c)


# This path cannot work: a process that sees no GPU cannot open CUDA IPC handles.
# What is tested is that it fails clearly. Ray 2.60 hides the GPU from a num_gpus=0
# actor only with RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1 (older Rays always did);
# CUDA_VISIBLE_DEVICES="" models that here.
@pytest.mark.parametrize("options", [{"device": "cpu"}, {}], ids=["device=cpu", "plain"])
def test_an_actor_that_sees_no_gpu_gets_an_error_naming_the_fix(gpu_pair, options):
    """The read ends in a raydirect error that names num_gpus, not a hang or a bare
    CUDA error, whether or not the reader asked for device="cpu"."""
    p, _ = gpu_pair
    hidden = {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}
    c = Peer.options(num_gpus=0, runtime_env=hidden).remote()
    try:
        assert ray.get(c.sees_gpu.remote()) is False
        [ref] = ray.get(p.put.remote("dtypes", "auto"))
        message = ray.get(c.try_read.remote([ref], **options), timeout=TIMEOUT)
        assert message.endswith("[RaydirectError]") and "num_gpus" in message, message
    finally:
        _kill(c)


# ---------------------------------------------------------------- lifetime


def test_in_place_write_warns_and_wait_tensor_freed_waits(gpu_pair):
    p, r = gpu_pair
    ray.get(p.record_warnings.remote())
    ref = p.keep.remote("mut")
    ray.wait([ref])
    assert ray.get(p.wait_freed.remote("mut", 0.2)).startswith("timeout: tensor still held")
    ray.get(p.write_in_place.remote("mut"))
    assert ray.get(r.try_read.remote([ref]), timeout=TIMEOUT) == "ok"
    found = wait_for(
        lambda: [w for w in ray.get(p.recorded_warnings.remote()) if "modified in place" in w],
        what="the mutation warning",
    )
    assert "wait_tensor_freed" in found[0] and "keep" in found[0]
    del ref
    assert ray.get(p.wait_freed.remote("mut", 30)) == "freed"


@pytest.fixture
def own_pair(ray_session):
    """A producer and a reader of the test's own, so that no earlier test's object
    moves the baseline. On the H200 the two memory tests below, on the module's pair
    right after a test failed, waited out 60 s for the producer's store to empty:
    refs of the failed test stayed alive in the driver (pytest keeps the last
    failure's traceback, frames and locals, in sys.last_traceback; the exception's
    frames form a cycle that only a full collection frees)."""
    p, r = Peer.remote(), Peer.remote()
    assert _alive(p, r)
    yield p, r
    _kill(p, r)


def _driver_refs_released() -> None:
    """Drop what the driver may still hold of earlier tests' refs (above)."""
    sys.last_type = sys.last_value = sys.last_traceback = None
    if hasattr(sys, "last_exc"):
        sys.last_exc = None
    gc.collect()


def test_cuda_memory_returns_to_its_baseline_in_both_processes(own_pair):
    """A CUDA object read three times frees its memory in both processes."""
    p, r = own_pair
    _driver_refs_released()
    base_p, base_r = ray.get([p.memory.remote(), r.memory.remote()])
    size = 256 * MiB
    ref = p.sized.remote(size)
    # Read three times: PyTorch's own IPC count, left on, would go wrong after one.
    for _ in range(3):
        measured = ray.get(r.read_and_measure.remote([ref]), timeout=TIMEOUT)
        assert measured["ok"], measured
        assert measured["while_held"] >= base_r + size, (base_r, measured)  # the copy was there
        assert measured["after"] <= base_r, (base_r, measured)
    assert ray.get(p.memory.remote()) >= base_p + size  # the producer holds it for the ref
    del ref
    gc.collect()
    wait_for(
        lambda: ray.get(p.memory.remote()) <= base_p,
        timeout=60,
        what=f"the producer's CUDA memory back to {base_p} bytes",
    )


def test_cuda_memory_of_an_object_nobody_read_is_released(own_pair):
    p, _ = own_pair
    _driver_refs_released()
    base = ray.get(p.memory.remote())
    ref = p.sized.remote(256 * MiB)
    ray.wait([ref])
    assert ray.get(p.memory.remote()) >= base + 256 * MiB
    del ref
    gc.collect()
    wait_for(
        lambda: ray.get(p.memory.remote()) <= base,
        timeout=60,
        what=f"the producer's CUDA memory back to {base} bytes",
    )


@ray.remote(num_cpus=0)
class Caller:
    """Owns the refs it makes (their objects stand on its lease): its death frees them."""

    def pid(self) -> int:
        return os.getpid()

    def hand_over(self, producer: Any, holder: Any, nbytes: int) -> None:
        ray.get(holder.hold.remote([producer.sized.remote(nbytes)]))


def test_a_read_through_a_dead_callers_ref_is_refused_never_another_tensors_bytes(own_pair):
    """tests/test_caller_leases.py's case over cuda_ipc: the holder read once, so Ray
    keeps the Payload there; the caller that owned the ref died, the producer freed
    the object and its caching allocator gave the memory to tensors of sevens. The
    holder's next read must fail (the seal), not return the sevens."""
    p, r = own_pair
    caller = Caller.remote()
    nbytes = 64 * MiB
    ray.get(caller.hand_over.remote(p, r, nbytes), timeout=TIMEOUT)
    assert ray.get(r.read_held.remote(), timeout=TIMEOUT) == "ok"
    os.kill(ray.get(caller.pid.remote()), signal.SIGKILL)
    wait_for(
        lambda: ray.get(p.stats.remote()).num_objects == 0,
        timeout=60,
        what="the object freed after its caller died",
    )
    ray.get(p.occupy.remote(nbytes, 4), timeout=TIMEOUT)
    said = ray.get(r.read_held.remote(), timeout=TIMEOUT)
    assert said.startswith("ProducerLostError") and "freed the object" in said, said


def test_a_cuda_object_read_once_is_freed_by_its_read(own_pair):
    """reads=1 on device memory (a pipeline stage's hand-off): its one read over
    cuda_ipc frees it, memory and all, while the ref lives; a second read, after
    the memory went to tensors of sevens, names the lifetime (the seal)."""
    p, r = own_pair
    _driver_refs_released()
    base = ray.get(p.memory.remote())
    nbytes = 64 * MiB
    ref = p.sized_once.remote(nbytes)
    measured = ray.get(r.read_and_measure.remote([ref]), timeout=TIMEOUT)
    assert measured["ok"], measured
    wait_for(
        lambda: ray.get(p.stats.remote()).num_objects == 0, timeout=60, what="freed by its read"
    )
    wait_for(lambda: ray.get(p.memory.remote()) <= base, timeout=60, what="its CUDA memory back")
    ray.get(p.occupy.remote(nbytes, 2), timeout=TIMEOUT)
    said = ray.get(r.try_read.remote([ref]), timeout=TIMEOUT)
    assert said.startswith("ProducerLostError") and "reads=1" in said, said


def _failed(reader: Any) -> dict | None:
    state = ray.get(reader.reading.remote())
    return state if state["error"] else None


@slow
def test_a_producer_killed_during_2_gib_reads_gives_a_clear_error(ray_session):
    """A reader reads a 2 GiB CUDA tensor again and again while its producer is
    killed: every read that finished was exact, and the first one after the kill
    ends in ProducerLostError or TransferError within the deadline, not a hang."""
    numel = 2 * GiB // 4
    p, r = Peer.remote(), Peer.remote()
    try:
        ref = p.arange.remote(numel)
        ray.wait([ref])
        ray.get(r.start_reading.remote([ref], numel))
        wait_for(
            lambda: ray.get(r.reading.remote())["ok"] >= 2, timeout=TIMEOUT, what="two good reads"
        )
        os.kill(ray.get(p.pid.remote()), signal.SIGKILL)
        # Longer than the reads' own 60 s deadline: a read that hangs until then fails
        # below as a FetchTimeoutError instead of here.
        state = wait_for(lambda: _failed(r), timeout=90, what="the reader's error after the kill")
        assert state["bad"] == 0, state
        assert state["error"].split(":")[0] in ("ProducerLostError", "TransferError"), state
    finally:
        _kill(p, r)


# ---------------------------------------------------------------- weight sync


def test_weight_sync_into_cuda_parameters(gpu_pair):
    p, r = gpu_pair
    ray.get([p.make_source.remote(1), r.make_target.remote(2)])
    for version in (1, 2):
        if version == 2:
            ray.get(p.step.remote())  # in place, after version 1 was published
        result = ray.get(r.load.remote(p.publish.remote(version)), timeout=TIMEOUT)
        want = ray.get(p.source_state.remote())
        assert result["version"] == version
        assert result["same_tensors"] is True  # the parameters themselves were written
        assert result["received"] == {"cuda_ipc": 1}, result  # one object per version
        assert set(result["state"]) == set(want)
        for name, tensor in want.items():
            got = result["state"][name]
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), name


# A CPU trainer's weights into a GPU engine, a GPU trainer's into host staging, and
# targets on both: a transport that writes the target's device writes it straight
# (cuda_ipc copies into host memory); the others read into scratch they write and
# the bytes are copied over once (cma into page-locked memory, then onto the GPU).
@pytest.mark.parametrize("world", [1, 2], ids=["whole", "tp2"])
@pytest.mark.parametrize(
    ("source", "target", "transports"),
    [
        ("cuda", "cpu", {"cuda_ipc"}),
        ("cpu", "cuda", {"cma", "shm"}),
        ("cuda", "cuda", {"cuda_ipc"}),
        ("cpu", "mixed", {"cma", "shm"}),
        ("cuda", "mixed", {"cuda_ipc"}),
    ],
)
def test_weight_sync_across_devices(gpu_pair, source, target, transports, world):
    p, r = gpu_pair
    ray.get([p.make_source.remote(1, source), r.make_target.remote(2, target, world)])
    shard = TensorParallel(world - 1, world)
    for version in (1, 2):
        if version == 2:
            ray.get(p.step.remote())  # in place, after version 1 was published
        result = ray.get(r.load.remote(p.publish.remote(version)), timeout=TIMEOUT)
        want = ray.get(p.source_state.remote())
        assert result["version"] == version and result["same_tensors"] is True, result
        assert sum(result["received"].values()) == 1, result  # one read of the version
        assert set(result["received"]) <= transports, result
        for name, tensor in want.items():
            on = "cuda" if target == "cuda" or (target == "mixed" and name[:2] == "0.") else "cpu"
            assert result["devices"][name] == on, (name, result["devices"])
            expect, got = shard.take(name, tensor), result["state"][name]
            assert got.dtype == expect.dtype and torch.equal(got, expect), name


def test_cuda_weights_in_a_worker_that_sees_no_gpu_are_refused_naming_the_fix(gpu_pair):
    """No transport reads CUDA memory into a process without a GPU: refused before
    a byte moves, the version unchanged, the error naming num_gpus."""
    p, _ = gpu_pair
    hidden = {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}
    c = Peer.options(num_gpus=0, runtime_env=hidden).remote()
    try:
        assert ray.get(c.sees_gpu.remote()) is False
        ray.get([p.make_source.remote(1, "cuda"), c.make_target.remote(2, "cpu")])
        result = ray.get(c.try_load.remote(p.publish.remote(1)), timeout=TIMEOUT)
        error = result["error"] or ""
        assert error.startswith("WeightSyncError") and "num_gpus" in error, result
        assert error.endswith("nothing was written"), result
        assert result["received"] == 0 and result["version"] is None, result
    finally:
        _kill(c)


# ---------------------------------------------------------------- NIXL on device memory


@pytest.mark.parametrize("case", ["dtypes", "views"])
def test_nixl_on_device_memory(gpu_pair, case):
    if not nixl_agent.available():
        pytest.skip(f"NIXL is not installed ({nixl_agent.INSTALL_HINT})")
    p, r = gpu_pair
    [ref] = ray.get(p.put.remote(case, "nixl"))
    result = ray.get(r.read.remote(case, [ref]), timeout=TIMEOUT)
    assert result == {"problem": None, "received": {"nixl": 1}}, result


def test_nixl_on_device_memory_without_peer_error_handling(ray_session):
    """With UCX's peer error handling (NIXL's default) UCX leaves out cuda_ipc and
    moved device memory at 0.45 GB/s on the H200; without it (what this sets) the
    cuda lanes are eligible. Exact values; the rate is printed, not judged."""
    if not nixl_agent.available():
        pytest.skip(f"NIXL is not installed ({nixl_agent.INSTALL_HINT})")
    env = {"RAYDIRECT_NIXL_UCX_ERROR_MODE": "none", "RAYDIRECT_NIXL_UCX_INFO": "1"}
    p, r = (Peer.options(runtime_env={"env_vars": env}).remote() for _ in range(2))
    try:
        [ref] = ray.get(p.put.remote("dtypes", "nixl"))
        result = ray.get(r.read.remote("dtypes", [ref]), timeout=TIMEOUT)
        assert result == {"problem": None, "received": {"nixl": 1}}, result
        big = p.sized_nixl.remote(256 * MiB)
        ray.get(r.try_read.remote([big]), timeout=TIMEOUT)  # the first read sets up
        seconds = ray.get(r.timed_read.remote([big]), timeout=TIMEOUT)
        print(f"nixl, error handling none: 256 MiB in {seconds * 1e3:.1f} ms")
    finally:
        _kill(p, r)
