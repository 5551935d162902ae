"""Actor classes shared by the tests (shipped to workers by value, see conftest)."""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from typing import Any

import numpy as np
import ray
import torch
from torch.testing._internal.two_tensor import TwoTensor

import raydirect as rd
from raydirect.testing import mismatch, wait_read_counts


class Tagged(torch.Tensor):
    """A subclass of its own, as a user's code may return."""


def _tagged(t: torch.Tensor) -> Tagged:
    made = t.as_subclass(Tagged)
    made.tag = "kept"  # type: ignore[attr-defined]
    return made


def make_value(case: str) -> Any:
    """Deterministic values: the producer and the checker build the same one."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(64, 32, generator=g)
    if case == "dtypes":
        return {
            "f32": base,
            "f16": base.half(),
            "bf16": base.bfloat16(),
            "f64": base.double(),
            "i8": (base * 10).to(torch.int8),
            "u8": (base * 10).abs().to(torch.uint8),
            "i64": torch.arange(100),
            "bool": base > 0,
            "c64": torch.complex(base, -base),
            "zero_d": torch.tensor(3.5),
            "empty": torch.empty(0, 5),
        }
    if case == "views":
        storage = torch.arange(1000, dtype=torch.float32)
        return {
            "transposed": base.t(),
            "strided": base[::3, 1::2],
            "slice_of_big": storage[100:140],
            "narrow_view": storage.view(10, 100)[2:4, 50:60],
            "expanded": torch.ones(3, 1).expand(3, 4),
        }
    if case == "aliasing":
        t = base.clone()
        return {"a": t, "b": t, "nested": [t, (t, {"deep": t})], "other": base + 1}
    if case == "numpy":
        return {
            "arr": np.arange(12, dtype=np.float64).reshape(3, 4),
            "ints": np.arange(7, dtype=np.int32),
            "noncontig": np.arange(20).reshape(4, 5)[:, ::2],
            "objects": np.array(["a", "b"], dtype=object),
            "strings": np.array(["x", "yz"]),
            "tensor": base,
        }
    if case == "large":  # above the inline limit: under auto, a direct object
        return {
            "f32": torch.randn(256, 128, generator=g),
            "i64": torch.arange(1000),
            "view": torch.arange(40_000, dtype=torch.float32)[100:30_000:3],
        }
    if case in ("unusual", "unusual_small"):  # tensors whose raw bytes are not their values
        c = torch.complex(base, -base)
        value = {
            "conj": c.conj(),
            "neg_0d": c.conj().imag[0, 0],  # contiguous, with the negative bit
            "coo": base.to_sparse(),
            "csr": base.to_sparse_csr(),
            "nested": torch.nested.nested_tensor([base[0], base[1, :5]]),
            "wrapper": TwoTensor(base[2].clone(), base[3].clone()),  # computes its values
            "tagged": _tagged(base[4].clone()),
            "plain": base,
        }
        if case == "unusual":  # above the inline limit: under auto, a direct object
            value["big_conj"] = torch.complex(torch.randn(256, 128, generator=g), base[0, 0]).conj()
        return value
    if case == "no_tensors":
        return {"a": 1, "b": [1, 2, "three"], "c": None}
    if case == "grad_state":  # a state dict (the fast path) with a tensor that wants grad
        return {"w": base.clone().requires_grad_(True), "b": base[0].clone(), "n": base[1] > 0}
    if case == "tied":  # a state dict naming one tensor twice (tied embeddings)
        return {"embed": base, "norm": base[0].clone(), "lm_head": base}
    if case == "params":
        return {
            "param": torch.nn.Parameter(base.clone()),
            "grad": base.clone().requires_grad_(True),
            "plain": base.clone(),
        }
    raise ValueError(case)


def empty_like_value(value: dict[str, Any]) -> dict[str, Any]:
    """Contiguous receive targets shaped like a value's tensors (a dict of them)."""
    out: dict[str, Any] = {}
    for key, t in value.items():
        if isinstance(t, np.ndarray):
            out[key] = np.empty(t.shape, dtype=t.dtype)
            continue
        target = torch.empty(t.shape, dtype=t.dtype)
        if isinstance(t, torch.nn.Parameter):
            target = torch.nn.Parameter(target, requires_grad=t.requires_grad)
        elif t.requires_grad:
            target.requires_grad_(True)
        out[key] = target
    return out


def _one_tensor(got: Any) -> bool:
    return got["a"] is got["b"] is got["nested"][0] is got["nested"][1][1]["deep"]


def check_value(case: str, got: Any) -> str | None:
    want = make_value(case)
    problem = mismatch(got, want)
    if problem is None and case == "aliasing" and not _one_tensor(got):
        problem = "the same tensor arrived as several tensors"
    if problem is None and case == "tied" and got["embed"] is not got["lm_head"]:
        problem = "the tied tensor arrived as two tensors"
    if (
        problem is None
        and case.startswith("unusual")
        and getattr(got["tagged"], "tag", 0) != "kept"
    ):
        problem = "the subclass's attribute did not arrive"
    return problem


@ray.remote(num_cpus=0)
class Producer:
    def __init__(self) -> None:
        self.kept: dict[str, Any] = {}
        self.warnings: list[str] = []
        self._gate = threading.Event()

    def pid(self) -> int:
        import os

        return os.getpid()

    def put(self, case: str, transport: str = "auto") -> list[ray.ObjectRef]:
        # Wrapped in a list so the driver receives the ref itself, not its value.
        return [rd.put(make_value(case), tensor_transport=transport)]

    @rd.method
    def value(self, case: str) -> Any:
        return make_value(case)

    @rd.method(tensor_transport="tcp")
    def value_tcp(self, case: str) -> Any:
        return make_value(case)

    @rd.method(tensor_transport="shm")
    def value_shm(self, case: str) -> Any:
        return make_value(case)

    @rd.method
    def conj_of_written(self) -> torch.Tensor:
        """A conjugated view of a tensor written before: its version counter is 1."""
        base = torch.complex(torch.ones(1 << 16), torch.ones(1 << 16))
        base.mul_(2)
        self.kept["conj"] = base
        return base.conj()

    @rd.method
    def big(self, nbytes: int, fill: int) -> torch.Tensor:
        t = torch.empty(nbytes, dtype=torch.uint8)
        t.fill_(fill)
        t[::4096] = (
            torch.arange(t[::4096].numel(), dtype=torch.int64).remainder(251).to(torch.uint8)
        )
        return t

    @rd.method
    def layers(self, count: int, weights: str = "bfloat16") -> dict[str, torch.Tensor]:
        """``count`` layers of a small model (weights of dtype ``weights``, float32
        biases): many tensors of a few shapes. Element ``i`` of layer ``k`` holds
        ``k + i % 7``."""
        out = {}
        dtype = getattr(torch, weights)
        for k in range(count):
            out[f"{k}.weight"] = (torch.arange(128 * 128) % 7 + k).to(dtype).view(128, 128)
            out[f"{k}.bias"] = (torch.arange(128) % 7 + k).to(torch.float32)
        return out

    @rd.method
    def keep(self, key: str, n: int = 20_000) -> torch.Tensor:
        """A tensor kept here (80 KB by default: above the inline limit, a direct object)."""
        self.kept[key] = torch.arange(n, dtype=torch.float32)
        return self.kept[key]

    @rd.method
    def keep_same(self) -> torch.Tensor:
        """The same live tensor every call (a server's cached output)."""
        if "same" not in self.kept:
            self.kept["same"] = torch.arange(10, dtype=torch.float32)
        return self.kept["same"]

    def requests_waiting(self) -> int:
        """Requests this process's agent has queued or is serving, and those
        waiting for a preparation to end (a callback on its future each)."""
        from raydirect import _runtime
        from raydirect._store import store

        futures = [f for o in list(store._objects.values()) for f in o.preparing.values()]
        waiting = sum(len(f._done_callbacks) - 1 for f in futures if not f.done())  # type: ignore[attr-defined]
        return _runtime.agent().admission.in_flight() + waiting

    def inline_entries(self) -> int:
        from raydirect import _payload

        return _payload.inline_entries()

    @rd.method
    def state(self) -> dict[str, torch.Tensor]:
        """A model's state_dict(): new tensor objects over the parameters' memory."""
        if not hasattr(self, "model"):
            self.model = torch.nn.Linear(256, 256)  # 256 KiB: never inline
        return self.model.state_dict()

    @rd.method
    def weight_view(self) -> torch.Tensor:
        """A view of part of a parameter's memory."""
        self.state()
        return self.model.weight.detach()[128:]

    def wait_weight_freed(self, timeout: float) -> str:
        try:
            rd.wait_tensor_freed(self.model.weight, timeout=timeout)
            return "freed"
        except TimeoutError as exc:
            return f"timeout: {exc}"

    def is_kept(self, key: str, value: Any) -> bool:
        """Passing a ref back to its producer must give the very same tensor."""
        return value is self.kept[key]

    def write_in_place(self, key: str) -> None:
        self.kept[key].add_(1)

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

    def stats(self) -> rd.LocalStats:
        return rd.local_stats()

    def block_forever(self) -> None:
        self._gate.wait()

    @ray.method(num_returns=2)
    @rd.method
    def two_below(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ones(3), torch.zeros(4)

    @rd.method
    @ray.method(num_returns=2)
    def two_above(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ones(5), torch.zeros(6)

    @rd.method(tensor_transport="pickle_shm")
    def value_plugin(self, case: str) -> Any:
        return make_value(case)

    @rd.method(tensor_transport="gated")
    def value_gated(self, case: str) -> Any:
        return make_value(case)

    @rd.method(tensor_transport="failing_prepare")
    def value_failing_prepare(self, case: str) -> Any:
        return make_value(case)

    @rd.method(tensor_transport="registered_late")
    def value_late(self, case: str) -> Any:
        return make_value(case)

    @rd.method(tensor_transport="gloo")
    def value_gloo(self, case: str) -> Any:
        return make_value(case)

    @rd.method(tensor_transport="gloo")
    def big_gloo(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), 7, dtype=torch.uint8)

    @rd.method(tensor_transport="gloo")
    def meta_tensor(self) -> torch.Tensor:
        return torch.empty(4, device="meta")

    @rd.method(tensor_transport="gloo")
    def fails(self) -> Any:
        raise KeyError("application error")

    def check(self, case: str, value: Any) -> str | None:
        return check_value(case, value)

    def check_nested(self, case: str, refs: list[ray.ObjectRef]) -> str | None:
        return check_value(case, ray.get(refs[0]))

    def check_many(self, case: str, *values: Any) -> list[str | None]:
        return [check_value(case, v) for v in values]

    def forward(self, member: Any, case: str, refs: list[ray.ObjectRef]) -> str | None:
        """Pass a ref this actor only borrowed on to another actor."""
        return ray.get(member.check_nested.remote(case, refs))

    def get_with_rd(
        self, refs: list[ray.ObjectRef], timeout: float | None = None, transport: str | None = None
    ) -> list[Any]:
        return rd.get(refs, timeout=timeout, tensor_transport=transport)

    def try_get(
        self, refs: list[ray.ObjectRef], timeout: float | None = None, transport: str | None = None
    ) -> str:
        try:
            rd.get(refs, timeout=timeout, tensor_transport=transport)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "ok"


@ray.remote(num_cpus=0)
class Consumer:
    def __init__(self) -> None:
        self.held: Any = None
        self._gate = threading.Event()

    def check(self, case: str, value: Any) -> str | None:
        return check_value(case, value)

    def check_nested(self, case: str, refs: list[ray.ObjectRef]) -> str | None:
        return check_value(case, ray.get(refs[0]))

    def check_twice(self, case: str, a: Any, b: Any) -> str | None:
        return check_value(case, a) or check_value(case, b)

    def summarize(self, value: Any) -> tuple[int, int, list[int]]:
        t = value
        return t.numel(), int(t[1]), t[::4096][:8].tolist()

    def hold(self, refs: list[ray.ObjectRef]) -> None:
        """Borrow: keep a nested ref alive after the caller dropped its own."""
        self.held = refs

    def check_held(self, case: str) -> str | None:
        return check_value(case, ray.get(self.held[0]))

    def check_after(self, case: str, value: Any, _gate: Any) -> str | None:
        return check_value(case, value)

    def drop(self) -> None:
        self.held = None

    def wait_gate(self, timeout: float) -> bool:
        return self._gate.wait(timeout)

    def open_gate(self) -> None:
        self._gate.set()

    def get_with_rd(self, refs: list[ray.ObjectRef], timeout: float | None = None) -> list[Any]:
        return rd.get(refs, timeout=timeout)

    def stats(self) -> rd.LocalStats:
        return rd.local_stats()

    def read_counted(self, refs: list[ray.ObjectRef]) -> bool:
        """Read ``refs``, then wait until their producers have counted the reads."""
        rd.get(refs, timeout=60)
        return wait_read_counts(timeout=30)

    def get_into(self, case: str, refs: list[ray.ObjectRef], transport: str | None = None) -> Any:
        """Receive into tensors of this actor's own; report what a user would check."""
        targets = empty_like_value(make_value(case))
        try:
            got = rd.get(refs[0], into=targets, tensor_transport=transport)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        same = all(got[k] is targets[k] for k in targets)
        return {"problem": check_value(case, got), "targets_returned": same}

    def get_into_mapped(
        self, case: str, refs: list[ray.ObjectRef], transport: str, access: int
    ) -> Any:
        """get_into with the f32 target over a file mapped with ``access`` (an
        ``mmap.ACCESS_*``): read-only memory is written, in the end, by a store
        from Python or C (or the kernel's copy); the error, or what get_into reports."""
        import mmap
        import tempfile

        targets = empty_like_value(make_value(case))
        f32 = targets["f32"]
        with tempfile.TemporaryFile(dir="/dev/shm") as f:
            f.truncate(f32.nbytes)
            mapped = mmap.mmap(f.fileno(), f32.nbytes, access=access)
        with warnings.catch_warnings():  # torch warns of a buffer it cannot write
            warnings.simplefilter("ignore")
            targets["f32"] = torch.frombuffer(mapped, dtype=f32.dtype).view(f32.shape)
        try:
            got = rd.get(refs[0], into=targets, tensor_transport=transport, timeout=60)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        same = all(got[k] is targets[k] for k in targets)
        return {"problem": check_value(case, got), "targets_returned": same}

    def get_into_bad(self, refs: list[ray.ObjectRef], targets: Any) -> str:
        """Targets the driver built to not fit; the error and whether bytes moved."""
        before = rd.local_stats().objects_received
        try:
            rd.get(refs[0], into=targets)
        except Exception as exc:
            moved = rd.local_stats().objects_received != before
            return f"{type(exc).__name__}: {exc}" + (" [bytes moved]" if moved else "")
        return "no error"

    def hint(self, case: str, refs: list[ray.ObjectRef]) -> None:
        self.targets = empty_like_value(make_value(case))
        rd.set_target(refs[0], self.targets)

    def read_hinted_arg(self, case: str, value: Any) -> dict[str, Any]:
        same = all(value[k] is self.targets[k] for k in self.targets)
        return {"problem": check_value(case, value), "targets_returned": same}

    def fetch_error(self, refs: list[ray.ObjectRef]) -> str:
        try:
            ray.get(refs[0])
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    def pid(self) -> int:
        import os

        return os.getpid()


@ray.remote(num_cpus=0, max_concurrency=4)
class ThreadedProducer:
    @rd.method
    def value(self, case: str) -> Any:
        time.sleep(0.01)
        return make_value(case)


@ray.remote(num_cpus=0)
class AsyncProducer:
    @rd.method
    async def value(self, case: str) -> Any:
        await asyncio.sleep(0.01)
        return make_value(case)


@ray.remote(num_cpus=0)
class AsyncReader:
    """Reads a large object while a ticker coroutine counts how often the loop ran."""

    def __init__(self) -> None:
        self.ticks = 0

    async def _tick(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.ticks += 1
            await asyncio.sleep(0.002)

    async def read_while_ticking(self, refs: list[ray.ObjectRef], how: str) -> dict[str, Any]:
        stop = asyncio.Event()
        ticker = asyncio.create_task(self._tick(stop))
        await asyncio.sleep(0)
        before = self.ticks
        if how == "get_async":
            value = await rd.get_async(refs[0], timeout=120)
        elif how == "await":
            value = await refs[0]
        else:  # the control: a blocking read on the loop's own thread
            value = rd.get(refs[0], timeout=120)
        ticks = self.ticks - before
        stop.set()
        await ticker
        return {"ticks": ticks, "numel": value.numel(), "first": int(value[1])}


@ray.remote(num_cpus=0)
class AsyncConsumer:
    async def check(self, case: str, value: Any) -> str | None:
        await asyncio.sleep(0)
        return check_value(case, value)

    async def check_nested(self, case: str, refs: list[ray.ObjectRef]) -> str | None:
        return check_value(case, await refs[0])


@ray.remote(num_cpus=0)
def task_put(case: str) -> list[ray.ObjectRef]:
    return [rd.put(make_value(case))]


@ray.remote(num_cpus=0)
def task_check(case: str, value: Any) -> str | None:
    return check_value(case, value)


# Run inside actors with __ray_call__ (Actor.__ray_call__.remote(fn, ...)).


def own_read(self: Any, refs: list[ray.ObjectRef]) -> dict[str, Any]:
    targets = empty_like_value(make_value("dtypes"))
    got = rd.get(refs[0], into=targets)
    return {
        "problem": check_value("dtypes", got),
        "targets_returned": all(got[k] is targets[k] for k in targets),
    }


def partial_read(self: Any, refs: list[ray.ObjectRef], targets: Any) -> tuple[bool, str | None]:
    got = rd.get(refs[0], into=targets)
    return got["f32"] is targets["f32"], check_value("dtypes", got)


def hint_plain(self: Any, refs: list[ray.ObjectRef]) -> str:
    try:
        rd.set_target(refs[0], {"x": None})
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def flat_read(self: Any, refs: list[ray.ObjectRef], case: str, as_tuple: bool) -> dict[str, Any]:
    """Ray's set_target_for_ref form: one target per tensor of the value, in order."""
    targets = empty_like_value(make_value(case))
    flat = list(targets.values())
    got = rd.get(refs[0], into=tuple(flat) if as_tuple else flat)
    same = all(got[k] is targets[k] for k in targets)
    return {"problem": check_value(case, got), "targets_returned": same}


def agent_address(self: Any) -> str:
    """This process's agent address (started if need be)."""
    from raydirect import _runtime

    return _runtime.agent().address


def held_objects(self: Any, transport: str) -> dict[str, str]:
    """Object id -> capability (hex) of what this process holds for ``transport``."""
    from raydirect._store import store

    objects = list(store._objects.items())
    return {k.hex(): o.capability.hex() for k, o in objects if o.transport == transport}


def break_dispatch_once(self: Any) -> None:
    """Make the agent's dispatch raise once, as a bug would."""
    from raydirect import _server

    real = _server._peek_op
    calls: list[int] = []

    def broken(frame: Any) -> str:
        if not calls:
            calls.append(1)
            raise RuntimeError("a bug in the agent's dispatch")
        return real(frame)

    _server._peek_op = broken


# ------------------------------------------------------------------ weight sync


def make_weights(count: int, rows: int = 64, cols: int = 32) -> dict[str, torch.Tensor]:
    """A model-like state: column-parallel, row-parallel and replicated tensors,
    plus an integer buffer (never cast)."""
    g = torch.Generator().manual_seed(11)
    weights = {}
    for i in range(count):
        kind = ("colpar", "rowpar", "rep")[i % 3]
        shape = (rows, cols) if kind != "rep" else (cols,)
        weights[f"{kind}{i}"] = torch.randn(shape, generator=g)
    weights["positions"] = torch.arange(rows)
    return weights


class TensorParallel:
    """shard(name, full_shape) for rank ``rank`` of ``world``: column-parallel
    weights split their rows, row-parallel ones their columns (strided), the rest
    is replicated."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def __call__(self, name: str, full_shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        dim = 0 if name.startswith("colpar") else 1 if name.startswith("rowpar") else None
        if dim is None:
            return None
        part = full_shape[dim] // self.world
        return (dim, self.rank * part, (self.rank + 1) * part)

    def take(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        spec = self(name, tuple(tensor.shape))
        return tensor if spec is None else tensor.narrow(spec[0], spec[1], spec[2] - spec[1])


class ColumnBlocks:
    """shard_blocks for ``world`` ranks: row-parallel weights stored as one block of
    columns per rank (and with ``rows``, column-parallel ones as blocks of rows)."""

    def __init__(self, world: int, rows: bool = False) -> None:
        self.world, self.rows = world, rows

    def __call__(self, name: str, full_shape: tuple[int, ...]) -> tuple[int, int] | None:
        if name.startswith("rowpar"):
            return (1, self.world)
        return (0, self.world) if self.rows and name.startswith("colpar") else None


@ray.remote(num_cpus=0)
class Trainer:
    def __init__(self, count: int, transport: str = "auto", **options: Any) -> None:
        self.weights = make_weights(count)
        self.publisher = rd.WeightPublisher(self.weights, tensor_transport=transport, **options)
        self.handles: list[Any] = []

    def pid(self) -> int:
        import os

        return os.getpid()

    def publish(self, version: int, timeout: float | None = None, keep: bool = False) -> Any:
        handle = self.publisher.publish(version, timeout=timeout)
        if keep:
            self.handles.append(handle)
        return handle

    def try_publish(self, version: int, timeout: float | None = None) -> str:
        try:
            self.publisher.publish(version, timeout=timeout)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "ok"

    def drop_handles(self) -> None:
        self.handles.clear()

    def step(self, wait_free: bool = False) -> None:
        """An optimizer step: every float weight changes in place (once no
        raydirect object holds it, with ``wait_free``)."""
        for tensor in self.weights.values():
            if wait_free:
                rd.wait_tensor_freed(tensor, timeout=60)
            if tensor.is_floating_point():
                tensor.add_(1.0)

    @rd.method
    def weights_dict(self) -> dict[str, torch.Tensor]:
        """The plain path: the live weights as a dict, no publisher."""
        return dict(self.weights)

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.weights.items()}

    def stats(self) -> rd.LocalStats:
        return rd.local_stats()


@ray.remote(num_cpus=0)
class Inference:
    """Holds its own tensors (a shard of each, with ``rank``/``world``) and loads versions."""

    def __init__(
        self, count: int, rank: int | None = None, world: int = 1, dtype: Any = None
    ) -> None:
        full = make_weights(count)
        self.shard = TensorParallel(rank, world) if rank is not None else None
        self.weights = {}
        for name, tensor in full.items():
            part = self.shard.take(name, tensor) if self.shard else tensor
            want = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            self.weights[name] = torch.zeros(part.shape, dtype=want)
        self.ids = {k: id(v) for k, v in self.weights.items()}
        self.sub = rd.WeightSubscriber(self.weights, shard=self.shard)

    def load(self, handle: Any, timeout: float | None = 60) -> int:
        return self.sub.load(handle, timeout=timeout)

    def try_load(self, handle: Any, timeout: float | None = 60) -> str:
        try:
            self.sub.load(handle, timeout=timeout)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "ok"

    def load_nested(self, handles: list[Any]) -> int:
        return self.sub.load(handles[0], timeout=60)

    def get_into(self, box: list[Any], names: list[str] | None = None) -> bool:
        """The plain path: rd.get of a dict into these weights (or those ``names``,
        in that order); True when the value returned holds the targets themselves."""
        into = self.weights if names is None else {n: self.weights[n] for n in names}
        got = rd.get(box[0], into=into, timeout=60)
        return all(got[name] is target for name, target in into.items())

    def version(self) -> int | None:
        return self.sub.version

    def swap_storage(self) -> None:
        """New memory under the same tensor objects (``param.data = ...``)."""
        for tensor in self.weights.values():
            tensor.data = torch.zeros_like(tensor)

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.weights.items()}

    def same_tensors(self) -> bool:
        return all(id(v) == self.ids[k] for k, v in self.weights.items())

    def received(self) -> int:
        return sum(rd.local_stats().bytes_received.values())

    def forward(self, other: Any, handles: list[Any]) -> int:
        """Pass a handle this actor only borrowed on to another actor."""
        return ray.get(other.load_nested.remote(handles))
