"""benchmarks/gpu.py's rows: each transfer timed, cold then steady, and checked."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import ray
import torch

from rdbench.common import (
    DTYPE,
    ELEMENT_BYTES,
    OBJECT_STORE,
    RDT_NIXL,
    Layout,
    Row,
    describe_error,
    fill_layout,
    format_size,
    layout_bytes,
    log,
    seeds,
    state_dict_layout,
)
from rdbench.fleet import raydirect_nixl_missing, rdt_nixl_missing
from rdbench.gpu_actors import (
    TIMEOUT_S,
    RdSink,
    RdSource,
    RdtSink,
    RdtSource,
    check_cuda,
    check_state,
)

RD_CUDA_IPC = "raydirect cuda_ipc"
RD_AUTO = "raydirect auto"
RD_NIXL = "raydirect nixl"
RD_WEIGHTS = "raydirect WeightPublisher"
RDT_CUDA_IPC = "ray RDT cuda_ipc"
FLOOR = "floor: device-to-device copy"
BASELINES = (OBJECT_STORE, RDT_CUDA_IPC)  # render_report adds RDT_NIXL where it ran


def run_rows(
    rows: Sequence[Row],
    repeats: int,
    operation: Callable[[int], Sequence[float]],
    seed_iter: Iterator[int],
) -> list[Row]:
    """One cold ``operation(seed)`` then ``repeats`` more; each returns one time per
    row (seconds). A failure ends the rows and is recorded in them."""
    where = f"w{rows[0].workload} {rows[0].system} @ {rows[0].param}"
    log(f"{where}: running (1 cold + {repeats})")
    try:
        for i in range(repeats + 1):
            times = operation(next(seed_iter))
            for row, seconds in zip(rows, times, strict=True):
                if i == 0:
                    row.cold_s = seconds
                else:
                    row.times_s.append(seconds)
    except Exception as exc:  # the row reads n/a; the others go on
        for row in rows:
            row.error = describe_error(exc)
        log(f"{where}: FAILED: {rows[0].error}")
    else:
        log(f"{where}: median {rows[0].median():.2f} GB/s")
    return list(rows)


def rdt_missing(transport: str) -> str | None:
    """Why Ray's RDT cannot use ``transport`` here, or None."""
    try:
        from ray.experimental.rdt.util import normalize_and_validate_tensor_transport
    except ImportError:
        normalize_and_validate_tensor_transport = None  # a Ray that moved it: just try
    if normalize_and_validate_tensor_transport is not None:
        try:
            normalize_and_validate_tensor_transport(transport)
        except ValueError as exc:
            return f"Ray {ray.__version__} has no RDT transport {transport!r} ({exc})"
    return rdt_nixl_missing() if transport == "nixl" else None


def skipped(workload: int, system: str, param: str, x: int, reason: str) -> list[Row]:
    log(f"w{workload} {system} @ {param}: skipped: {reason}")
    return [Row(workload, system, param, x, x, skipped=reason)]


class Bench:
    def __init__(self, repeats: int, sync_steps: int) -> None:
        self.repeats, self.sync_steps = repeats, sync_steps
        self.seed_iter = seeds()
        self.rd, self.rd_sink = RdSource.remote(), RdSink.remote()
        self.rdt, self.rdt_sink = RdtSource.remote(), RdtSink.remote()
        ray.get([a.__ray_ready__.remote() for a in self.actors()], timeout=TIMEOUT_S)

    def actors(self) -> list[Any]:
        return [self.rd, self.rd_sink, self.rdt, self.rdt_sink]

    def allocate(self, layout: Layout) -> None:
        ray.get(
            [self.rd.allocate.remote(layout), self.rdt.allocate.remote(layout)], timeout=TIMEOUT_S
        )

    # -- workloads 1 and 2
    def transfer(
        self,
        system: str,
        nbytes: int,
        source: Any,
        call: Callable[[], Any],
        sink: Any,
        how: str,
    ) -> list[Row]:
        """Rows of workloads 1 and 2: the consumer reads the ref it gets in a list
        and times its own read (``how``: rd.get, or the object store)."""
        param = format_size(nbytes)

        def operation(seed: int) -> tuple[float, float]:
            ray.get(source.prepare.remote(seed), timeout=TIMEOUT_S)
            start = time.perf_counter()
            ref = call()
            inner = ray.get(sink.receive.remote(how, [ref]), timeout=TIMEOUT_S)
            total = time.perf_counter() - start
            ray.get(sink.check_last.remote(seed, nbytes), timeout=TIMEOUT_S)
            return total, inner

        rows = [Row(w, system, param, nbytes, nbytes) for w in (1, 2)]
        return run_rows(rows, self.repeats, operation, self.seed_iter)

    def rdt_transfer(self, system: str, transport: str, nbytes: int) -> list[Row]:
        """Ray's RDT over ``transport`` (skipped where it cannot run): its ref goes
        to the consumer as a direct task argument, the one way RDT supports, so
        only workload 1 (end to end) is timed: Ray moves the tensor before the
        consumer's method runs."""
        param = format_size(nbytes)
        missing = rdt_missing(transport)
        if missing:
            return [r for w in (1, 2) for r in skipped(w, system, param, nbytes, missing)]
        sink = self.rdt_sink
        method = self.rdt.one.options(tensor_transport=transport)

        def call() -> Any:
            return method.remote("x")

        def operation(seed: int) -> tuple[float]:
            ray.get(self.rdt.prepare.remote(seed), timeout=TIMEOUT_S)
            start = time.perf_counter()
            ray.get(sink.receive_value.remote(call()), timeout=TIMEOUT_S)
            total = time.perf_counter() - start
            ray.get(sink.check_last.remote(seed, nbytes), timeout=TIMEOUT_S)
            return (total,)

        rows = run_rows(
            [Row(1, system, param, nbytes, nbytes)], self.repeats, operation, self.seed_iter
        )
        why = "RDT resolves a direct argument before the method runs: no receive-only time"
        return rows + [Row(2, system, param, nbytes, nbytes, skipped=why)]

    def sizes(self, nbytes: int) -> list[Row]:
        self.allocate({"x": (nbytes // ELEMENT_BYTES,)})
        rows = []
        for system, method in ((RD_CUDA_IPC, "one_cuda_ipc"), (RD_AUTO, "one_auto")):
            bound = getattr(self.rd, method)
            rows += self.transfer(
                system, nbytes, self.rd, lambda b=bound: b.remote("x"), self.rd_sink, "rd.get"
            )
        rows += self.transfer(
            OBJECT_STORE,
            nbytes,
            self.rd,
            lambda: self.rd.one.remote("x"),
            self.rd_sink,
            "object store",
        )
        rows += self.rdt_transfer(RDT_CUDA_IPC, "cuda_ipc", nbytes)
        return rows + floor(nbytes, self.repeats, self.seed_iter)

    def nixl_sizes(self, nbytes: int) -> list[Row]:
        """NIXL rows, after all others: a NIXL agent's progress thread keeps polling
        for the life of its process (benchmarks/README.md)."""
        param = format_size(nbytes)
        self.allocate({"x": (nbytes // ELEMENT_BYTES,)})
        rows = []
        missing = raydirect_nixl_missing()
        if missing:
            rows += [r for w in (1, 2) for r in skipped(w, RD_NIXL, param, nbytes, missing)]
        else:
            rows += self.transfer(
                RD_NIXL,
                nbytes,
                self.rd,
                lambda: self.rd.one_nixl.remote("x"),
                self.rd_sink,
                "rd.get",
            )
        return rows + self.rdt_transfer(RDT_NIXL, "nixl", nbytes)

    # -- workload 3
    def weight_sync(self, state_bytes: int) -> list[Row]:
        layout = state_dict_layout(state_bytes)
        nbytes = layout_bytes(layout)
        param = f"{format_size(state_bytes)}, {len(layout)} tensors"
        self.allocate(layout)
        ray.get(
            [self.rd_sink.set_layout.remote(layout), self.rdt_sink.set_layout.remote(layout)],
            timeout=TIMEOUT_S,
        )

        def timed(source: Any, sink: Any, step: Callable[[], Any]) -> Callable[[int], list]:
            def operation(seed: int) -> list[float]:
                ray.get(source.prepare.remote(seed), timeout=TIMEOUT_S)
                start = time.perf_counter()
                ray.get(step(), timeout=TIMEOUT_S)
                seconds = time.perf_counter() - start
                ray.get(sink.check_targets.remote(seed), timeout=TIMEOUT_S)
                return [seconds]

            return operation

        def row(system: str) -> list[Row]:
            return [Row(3, system, param, nbytes, nbytes)]

        rd_src, rd_sink, rdt_src, rdt_sink = self.actors()
        rows = run_rows(
            row(RD_WEIGHTS),
            self.sync_steps,
            timed(rd_src, rd_sink, lambda: rd_sink.load_weights.remote(rd_src.publish.remote())),
            self.seed_iter,
        )
        rows += run_rows(
            row(OBJECT_STORE),
            self.sync_steps,
            timed(rd_src, rd_sink, lambda: rd_sink.copy_state.remote(rd_src.state.remote())),
            self.seed_iter,
        )
        missing = rdt_missing("cuda_ipc")
        if missing:
            rows += skipped(3, RDT_CUDA_IPC, param, nbytes, missing)
        else:
            call = rdt_src.state.options(tensor_transport="cuda_ipc")
            rows += run_rows(
                row(RDT_CUDA_IPC),
                self.sync_steps,
                timed(rdt_src, rdt_sink, lambda: rdt_sink.copy_state.remote(call.remote())),
                self.seed_iter,
            )
        return rows + state_floor(layout, self.sync_steps, self.seed_iter, param)

    def close(self) -> None:
        for actor in self.actors():
            ray.kill(actor)


def floor(nbytes: int, repeats: int, seed_iter: Iterator[int]) -> list[Row]:
    """In the driver: ``dst.copy_(src)`` between two CUDA tensors, then synchronize."""
    src = torch.empty(nbytes // ELEMENT_BYTES, dtype=DTYPE, device="cuda")
    dst = torch.empty_like(src)

    def operation(seed: int) -> tuple[float, float]:
        fill_layout({"x": src}, seed)
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        check_cuda(dst, seed, nbytes)
        return seconds, seconds

    param = format_size(nbytes)
    return run_rows(
        [Row(w, FLOOR, param, nbytes, nbytes) for w in (1, 2)], repeats, operation, seed_iter
    )


def state_floor(layout: Layout, steps: int, seed_iter: Iterator[int], param: str) -> list[Row]:
    src = {n: torch.empty(s, dtype=DTYPE, device="cuda") for n, s in layout.items()}
    dst = {n: torch.empty(s, dtype=DTYPE, device="cuda") for n, s in layout.items()}

    def operation(seed: int) -> list[float]:
        fill_layout(src, seed)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for name, target in dst.items():
            target.copy_(src[name])
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        check_state(dst, layout, seed)
        return [seconds]

    nbytes = layout_bytes(layout)
    return run_rows([Row(3, FLOOR, param, nbytes, nbytes)], steps, operation, seed_iter)
