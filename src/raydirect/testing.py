"""A conformance suite for transports, for transport authors and for raydirect.

Prove a transport in a few lines (pytest collects the ``test_*`` methods; the
library itself does not depend on pytest)::

    import raydirect.testing

    class TestMyTransport(raydirect.testing.TransportConformance):
        transport = "mine"            # the registered name

        @classmethod
        def register(cls):            # optional: runs once, before the actors start
            rd.register_tensor_transport("mine", ["cpu"], MyTransport, replace=True)

The suite connects to Ray (``ray.init()`` if nothing is connected), starts a
producer and a consumer actor, and checks that values of every dtype, shape
and aliasing arrive exactly, that the transport (not a fallback) moved them,
that the driver can read them, that several refs are fetched together, and
that the producer frees what it held once the refs are gone. raydirect runs
this suite over each of its own transports.
"""

from __future__ import annotations

import threading
import time
from typing import Any, ClassVar

import numpy as np
import ray
import torch

import raydirect as rd
from raydirect import _notices

CASES = ("dtypes", "views", "aliasing", "nested", "large")
_FREE_TIMEOUT_S = 30.0


def wait_read_counts(timeout: float | None = 10.0) -> bool:
    """In a process that read objects over one-sided transports (``cma``,
    ``cuda_ipc``, ``nixl``): wait until every such read it made so far is counted
    in its producer's ``rd.local_stats()`` (``objects_sent``, ``bytes_sent``), or
    dropped because that producer is gone. A read is reported after the call that
    made it returns, by a thread of its own: its count lands 2-20 ms later on an
    idle machine, seconds later under a flood of requests to the producer.
    Returns False if some were still uncounted at ``timeout`` seconds."""
    return _notices.notices.settle(timeout)


def make_value(case: str, data_type: type = torch.Tensor) -> Any:
    """A deterministic value: producer and checker build the same one."""
    g = torch.Generator().manual_seed(11)
    base = torch.randn(16, 8, generator=g)
    if data_type is np.ndarray:
        arr = base.numpy()
        values: dict[str, Any] = {
            "f32": arr,
            "i16": (arr * 100).astype(np.int16),
            "bool": arr > 0,
            "c64": (arr + 1j * arr).astype(np.complex64),
            "empty": np.empty((0, 3)),
            "strided": arr[::2, 1::3],
        }
        return {"large": np.arange(8 << 20, dtype=np.int64)} if case == "large" else values
    if case == "dtypes":
        return {
            "f32": base,
            "f16": base.half(),
            "bf16": base.bfloat16(),
            "f64": base.double(),
            "i8": (base * 10).to(torch.int8),
            "u8": (base * 10).abs().to(torch.uint8),
            "i64": torch.arange(50),
            "bool": base > 0,
            "c64": torch.complex(base, -base),
            "zero_d": torch.tensor(2.5),
            "empty": torch.empty(0, 4),
        }
    if case == "views":
        storage = torch.arange(400, dtype=torch.float32)
        return {
            "t": base.t(),
            "strided": base[::3, 1::2],
            "slice": storage[50:90],
            "narrow": storage.view(20, 20)[3:5, 4:9],
        }
    if case == "aliasing":
        t = base.clone()
        return {"a": t, "b": t, "list": [t, (t, base + 1)]}
    if case == "nested":
        return {
            "config": {"lr": 0.1, "name": "w"},
            "layers": [[base, base * 2], (base * 3,)],
            "none": None,
        }
    if case == "large":
        return {"large": torch.arange(16 << 20, dtype=torch.int32)}  # 64 MiB
    raise ValueError(f"unknown case {case!r}")


def mismatch(got: Any, want: Any, path: str = "value") -> str | None:
    """None when ``got`` equals ``want`` in value, dtype, shape and type; else where not."""
    if isinstance(want, torch.Tensor):
        if type(got) is not type(want) or got.dtype != want.dtype or _shape(got) != _shape(want):
            return f"{path}: {type(got).__name__} {getattr(got, 'dtype', '')} {_shape(got)}"
        if got.requires_grad != want.requires_grad:
            return f"{path}: requires_grad {got.requires_grad} != {want.requires_grad}"
        if (got.layout, got.is_nested) != (want.layout, want.is_nested):
            return f"{path}: layout {got.layout} (nested: {got.is_nested})"
        return None if _equal(got.detach(), want.detach()) else f"{path}: values differ"
    if isinstance(want, np.ndarray):
        if not isinstance(got, np.ndarray) or got.dtype != want.dtype or got.shape != want.shape:
            return f"{path}: {type(got).__name__} {getattr(got, 'dtype', '')}"
        return None if np.array_equal(got, want) else f"{path}: values differ"
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return f"{path}: keys differ"
        return next((m for k in want if (m := mismatch(got[k], want[k], f"{path}.{k}"))), None)
    if isinstance(want, (list, tuple)):
        if type(got) is not type(want) or len(got) != len(want):
            return f"{path}: {type(got).__name__} of {len(got)}"
        return next(
            (
                m
                for i, (g, w) in enumerate(zip(got, want, strict=True))
                if (m := mismatch(g, w, f"{path}[{i}]"))
            ),
            None,
        )
    return None if got == want else f"{path}: {got!r} != {want!r}"


def _shape(t: Any) -> Any:
    """A nested tensor has no one shape: its count of pieces (each compared by ``_equal``)."""
    if isinstance(t, torch.Tensor) and t.is_nested:
        return ("nested", t.size(0))
    return tuple(getattr(t, "shape", ()))


def _equal(got: torch.Tensor, want: torch.Tensor) -> bool:
    """``torch.equal``, which sparse and nested tensors do not support."""
    if want.is_nested:
        pieces = list(zip(got.unbind(), want.unbind(), strict=False))
        return len(pieces) == want.size(0) and all(torch.equal(g, w) for g, w in pieces)
    if want.layout != torch.strided:
        return torch.equal(got.to_dense(), want.to_dense())
    return torch.equal(got, want)


def check(case: str, got: Any, data_type: type = torch.Tensor) -> str | None:
    """What is wrong with ``got`` as the value of ``case`` (``None`` if it arrived
    exactly), including tensors that were one tensor and arrived as several."""
    problem = mismatch(got, make_value(case, data_type))
    if (
        problem is None
        and case == "aliasing"
        and data_type is torch.Tensor
        and not (got["a"] is got["b"] is got["list"][0] is got["list"][1][0])
    ):
        problem = "the same tensor arrived as several tensors"
    return problem


class _Member:
    """Producer and consumer in one class: any two instances form a pair."""

    def put(self, case: str, transport: str, data_type: type) -> list[ray.ObjectRef]:
        return [rd.put(make_value(case, data_type), tensor_transport=transport)]

    def check(self, case: str, value: Any, data_type: type) -> str | None:
        return check(case, value, data_type)

    def check_many(self, case: str, refs: list[ray.ObjectRef], data_type: type) -> list[Any]:
        return [check(case, v, data_type) for v in rd.get(refs, timeout=120)]

    def stats(self) -> rd.LocalStats:
        return rd.local_stats()

    def read_error(self, refs: list[ray.ObjectRef], timeout: float | None) -> str:
        """What reading the object raises here (``ok`` if nothing)."""
        try:
            rd.get(refs[0], timeout=timeout)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "ok"

    def aborts(self) -> int:
        return len(_ABORTS)


Member = ray.remote(num_cpus=0)(_Member)

# ------------------------------------------------ two-sided failure cases
#
# Derived from the transport under test: its send raises, or its send and receive
# hang until aborted. Each process records the aborts it saw.

_ABORTS: list[str] = []
_ABORTED = threading.Event()
_HANG_S = 60.0


def _send_raises(self: Any, tensors: Any, meta: Any, comm: Any) -> None:
    raise RuntimeError("the conformance suite broke this send")


def _hang_send(self: Any, tensors: Any, meta: Any, comm: Any) -> None:
    _ABORTED.wait(_HANG_S)


def _hang_recv(self: Any, obj_id: Any, meta: Any, comm: Any, target_buffers: Any = None) -> Any:
    _ABORTED.wait(_HANG_S)
    raise RuntimeError("aborted")


def _record_abort(self: Any, obj_id: Any, comm: Any) -> None:
    _ABORTS.append(str(obj_id))
    _ABORTED.set()


def _can_abort(cls: Any) -> bool:
    return True


def failing(manager_cls: type[rd.TensorTransportManager], how: str) -> type:
    """``manager_cls`` whose send raises (``how="send"``), or whose send and
    receive hang until aborted (``how="hang"``; it can abort)."""
    if how == "send":
        body: dict[str, Any] = {"send_multiple_tensors": _send_raises}
    else:
        body = {
            "send_multiple_tensors": _hang_send,
            "recv_multiple_tensors": _hang_recv,
            "abort_transport": _record_abort,
            "can_abort_transport": classmethod(_can_abort),
        }
    return type(f"{manager_cls.__name__}_{how}", (manager_cls,), body)


class TransportConformance:
    """Subclass, set ``transport`` (and ``data_type`` for numpy transports,
    ``group_backend`` for transports that need a collective group). For a
    two-sided plug-in also set ``manager_cls`` (the registered class) and
    ``devices``: the suite then registers variants of it whose send fails or
    hangs, and checks the errors, the deadline and the aborts on both sides."""

    transport: ClassVar[str] = ""
    data_type: ClassVar[type] = torch.Tensor
    group_backend: ClassVar[str | None] = None
    manager_cls: ClassVar[type[rd.TensorTransportManager] | None] = None
    devices: ClassVar[list[str]] = ["cpu"]

    producer: ClassVar[Any] = None
    consumer: ClassVar[Any] = None
    _group: ClassVar[str | None] = None

    @classmethod
    def register(cls) -> None:
        """Override to register the transport before the actors start."""

    @classmethod
    def setup_class(cls) -> None:
        if not cls.transport:
            raise TypeError(f"{cls.__name__} must set `transport`")
        if not ray.is_initialized():
            ray.init()
        cls.register()
        cls.producer, cls.consumer = Member.remote(), Member.remote()
        if cls.group_backend:
            cls._group = rd.create_collective_group(
                [cls.producer, cls.consumer], backend=cls.group_backend
            )

    @classmethod
    def teardown_class(cls) -> None:
        if cls._group:
            rd.destroy_collective_group(cls._group)
        for actor in (cls.producer, cls.consumer):
            if actor is not None:
                ray.kill(actor)

    # ---- helpers
    def _put(self, case: str) -> ray.ObjectRef:
        [ref] = ray.get(self.producer.put.remote(case, self.transport, self.data_type))
        return ref

    def _received(self) -> int:
        return ray.get(self.consumer.stats.remote()).objects_received.get(self.transport, 0)

    # ---- the suite
    def test_values_arrive_exactly_over_this_transport(self) -> None:
        for case in CASES:
            before = self._received()
            problem = ray.get(self.consumer.check.remote(case, self._put(case), self.data_type))
            assert problem is None, f"{case}: {problem}"
            assert self._received() == before + 1, f"{case}: not moved by {self.transport!r}"

    def test_driver_reads_it(self) -> None:
        ref = self._put("dtypes")
        assert check("dtypes", ray.get(ref), self.data_type) is None
        assert check("dtypes", rd.get(ref, timeout=60), self.data_type) is None

    def test_several_refs_at_once(self) -> None:
        refs = [self._put("views") for _ in range(4)]
        assert ray.get(self.consumer.check_many.remote("views", refs, self.data_type)) == [None] * 4

    def test_producer_frees_what_it_held(self) -> None:
        ref = self._put("large")
        assert ray.get(self.consumer.check.remote("large", ref, self.data_type)) is None
        del ref
        deadline = time.monotonic() + _FREE_TIMEOUT_S
        while ray.get(self.producer.stats.remote()).num_objects:
            assert time.monotonic() < deadline, "the producer still holds objects"
            time.sleep(0.05)

    # ---- two-sided plug-ins: failures
    def _variant(self, how: str) -> str:
        cls = self.manager_cls
        if cls is None or cls.is_one_sided():
            import pytest  # the suite runs under pytest; the library does not need it

            pytest.skip("a two-sided plug-in case: set manager_cls to a two-sided transport")
        name = f"{self.transport}-{how}"
        rd.register_tensor_transport(
            name, self.devices, failing(cls, how), self.data_type, replace=True
        )
        return name

    def _read_error(self, name: str, timeout: float | None) -> str:
        [ref] = ray.get(self.producer.put.remote("dtypes", name, self.data_type))
        return str(ray.get(self.consumer.read_error.remote([ref], timeout), timeout=120))

    def test_a_failing_send_is_a_transfer_error_naming_the_transport(self) -> None:
        name = self._variant("send")
        error = self._read_error(name, 60)
        assert error.startswith("TransferError") and name in error, error
        assert "broke this send" in error, error
        self.test_values_arrive_exactly_over_this_transport()  # both actors still work

    def test_a_hanging_transfer_ends_at_the_deadline_and_both_sides_abort(self) -> None:
        name = self._variant("hang")
        before = [ray.get(m.aborts.remote()) for m in (self.producer, self.consumer)]
        started = time.monotonic()
        error = self._read_error(name, 3.0)
        assert error.startswith("FetchTimeoutError"), error
        assert time.monotonic() - started < 30
        deadline = time.monotonic() + _FREE_TIMEOUT_S
        while True:  # the producer hears of the abort through its agent: poll
            after = [ray.get(m.aborts.remote()) for m in (self.producer, self.consumer)]
            if all(a > b for a, b in zip(after, before, strict=True)):
                break
            assert time.monotonic() < deadline, (
                f"abort_transport ran {after} times, {before} before"
            )
            time.sleep(0.05)
