"""raydirect on one CUDA GPU against Ray's RDT and Ray's object store.

1. one CUDA tensor, actor -> actor on one GPU, 1 MiB ... 4 GiB, end to end from the driver
2. the same transfers, receive only (timed inside the consumer)
3. weight sync: a 256 MiB state dict of 200 CUDA tensors, one publisher, one subscriber

Rows: raydirect cuda_ipc / auto / nixl, Ray RDT over CUDA IPC and over NIXL
(``.options(tensor_transport=...)``), Ray's object store (the tensor returned
normally, ``.cuda()`` on receipt), and the floor: one device-to-device copy in one
process. Every transfer is checked element by element, outside the timed region.
Tables (markdown, GB/s and ratios) go to stdout, progress to stderr.

    python benchmarks/gpu.py [--sizes 1MiB,16MiB,256MiB,1GiB,4GiB] [--repeats 5]
                             [--state-size 256MiB] [--sync-steps 10]
                             [--json PATH] [--skip-if-no-gpu]

Without a CUDA GPU it says so and exits 2 (0 with ``--skip-if-no-gpu``). See
docs/gpu.md and benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # rdbench, also for Ray's workers

import ray  # noqa: E402
import torch  # noqa: E402
from rdbench.common import (  # noqa: E402
    DTYPE,
    ELEMENT_BYTES,
    GIB,
    KIB,
    MIB,
    OBJECT_STORE,
    RDT_NIXL,
    Layout,
    Row,
    Workload,
    describe_error,
    fill_layout,
    format_size,
    layout_bytes,
    log,
    part_seed,
    seeds,
    state_dict_layout,
)
from rdbench.fleet import raydirect_nixl_missing, rdt_nixl_missing  # noqa: E402
from rdbench.report import machine_facts, order_rows, render_report, report_json  # noqa: E402

import raydirect as rd  # noqa: E402

GPU_SHARE = 0.25  # four actors (two producers, two consumers) on the one GPU
MAX_BYTES = 4 * GIB  # int32 pattern: i + seed stays below 2**31 (seeds < 2**30)
CHECK_CHUNK = 64 * MIB  # elements compared per step (a 256 MiB expected tensor)
TIMEOUT_S = 300.0  # one transfer, one setup call
FREE_TIMEOUT_S = 60.0

RD_CUDA_IPC = "raydirect cuda_ipc"
RD_AUTO = "raydirect auto"
RD_NIXL = "raydirect nixl"
RD_WEIGHTS = "raydirect WeightPublisher"
RDT_CUDA_IPC = "ray RDT cuda_ipc"
FLOOR = "floor: device-to-device copy"
BASELINES = (OBJECT_STORE, RDT_CUDA_IPC)  # render_report adds RDT_NIXL where it ran


def _no_run(_ctx: Any) -> list[Row]:
    return []  # rows are made by main(); Workload only describes the tables


WORKLOADS = {
    1: Workload(
        1,
        "one CUDA tensor, actor -> actor on one GPU, end to end",
        "size",
        "GB/s",
        BASELINES,
        _no_run,
    ),
    2: Workload(
        2,
        "the same transfers, receive only (timed inside the consumer)",
        "size",
        "GB/s",
        BASELINES,
        _no_run,
    ),
    3: Workload(
        3,
        "weight sync: one publisher, one subscriber, CUDA state dict",
        "state",
        "GB/s",
        BASELINES,
        _no_run,
    ),
}


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


# ---------------------------------------------------------------- timing


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

    def sizes(self, nbytes: int) -> list[Row]:
        param = format_size(nbytes)
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
        missing = rdt_missing("cuda_ipc")
        if missing:
            rows += [r for w in (1, 2) for r in skipped(w, RDT_CUDA_IPC, param, nbytes, missing)]
        else:
            call = self.rdt.one.options(tensor_transport="cuda_ipc")
            rows += self.transfer(
                RDT_CUDA_IPC, nbytes, self.rdt, lambda: call.remote("x"), self.rdt_sink, "ray.get"
            )
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
        missing = rdt_missing("nixl")
        if missing:
            rows += [r for w in (1, 2) for r in skipped(w, RDT_NIXL, param, nbytes, missing)]
        else:
            call = self.rdt.one.options(tensor_transport="nixl")
            rows += self.transfer(
                RDT_NIXL, nbytes, self.rdt, lambda: call.remote("x"), self.rdt_sink, "ray.get"
            )
        return rows

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


# ---------------------------------------------------------------- command line


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]iB|B)?\s*", text, flags=re.IGNORECASE)
    units = {"": 1, "b": 1, "kib": KIB, "mib": MIB, "gib": GIB}
    if not match:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: write e.g. 1MiB, 256MiB, 4GiB")
    nbytes = int(match.group(1)) * units[(match.group(2) or "").lower()]
    if nbytes <= 0 or nbytes % ELEMENT_BYTES or nbytes > MAX_BYTES:
        raise argparse.ArgumentTypeError(
            f"size {text!r} must be a positive multiple of {ELEMENT_BYTES} bytes, at most 4GiB"
        )
    return nbytes


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="benchmarks/gpu.py", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument(
        "--sizes",
        default="1MiB,16MiB,256MiB,1GiB,4GiB",
        help="workloads 1-2: comma-separated sizes [%(default)s]",
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed transfers after the cold one [%(default)s]"
    )
    parser.add_argument(
        "--state-size", default="256MiB", help="workload 3: the state dict's size [%(default)s]"
    )
    parser.add_argument(
        "--sync-steps",
        type=int,
        default=10,
        help="workload 3: timed syncs after the cold one [%(default)s]",
    )
    parser.add_argument(
        "--json", metavar="PATH", help="write every raw timing here ('-': stdout, tables to stderr)"
    )
    parser.add_argument(
        "--skip-if-no-gpu",
        action="store_true",
        help="exit 0 instead of 2 where there is no CUDA GPU",
    )
    args = parser.parse_args(argv)
    try:
        args.size_list = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
        args.state_bytes = parse_size(args.state_size)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.state_bytes < MIB:
        parser.error("--state-size must be at least 1MiB")
    if args.repeats < 1 or args.sync_steps < 1:
        parser.error("--repeats and --sync-steps must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "benchmarks/gpu.py needs a CUDA GPU; this machine has none "
            "(torch.cuda.is_available() is False). Run it where one is: docs/gpu.md.",
            file=sys.stderr,
        )
        return 0 if args.skip_if_no_gpu else 2
    facts = {
        **machine_facts(),
        "worker_env": {},  # no THP_MEM_ALLOC_ENABLE here: GPU memory is the subject
        "gpu": torch.cuda.get_device_name(),
        "gpus": torch.cuda.device_count(),
        "cuda": torch.version.cuda,
    }
    header = (
        f"# {facts['gpu']} ({facts['gpus']} visible), CUDA {facts['cuda']}, {facts['cores']} "
        f"cores, torch {facts['torch']}, ray {facts['ray']}, raydirect {facts['raydirect']}, "
        f"python {facts['python']}"
    )
    log(header.removeprefix("# "))
    started = time.perf_counter()
    ray.init(
        num_cpus=8,
        num_gpus=torch.cuda.device_count(),
        include_dashboard=False,
        logging_level=logging.WARNING,
    )
    rows: list[Row] = []
    try:
        bench = Bench(args.repeats, args.sync_steps)
        for nbytes in args.size_list:
            log(f"== {format_size(nbytes)}")
            rows += bench.sizes(nbytes)
        log(f"== weight sync, {format_size(args.state_bytes)}")
        rows += bench.weight_sync(args.state_bytes)
        for nbytes in args.size_list:
            log(f"== NIXL, {format_size(nbytes)}")
            rows += bench.nixl_sizes(nbytes)
        bench.close()
    finally:
        ray.shutdown()
    elapsed = time.perf_counter() - started
    rows = order_rows(rows)
    workloads = list(WORKLOADS.values())
    text = render_report(workloads, rows, header, elapsed)
    print(text, file=sys.stderr if args.json == "-" else sys.stdout, flush=True)
    if args.json:
        settings = {
            "sizes": args.size_list,
            "repeats": args.repeats,
            "state_bytes": args.state_bytes,
            "sync_steps": args.sync_steps,
            "gpu_share": GPU_SHARE,
        }
        report = report_json(workloads, rows, facts, settings, elapsed)
        if args.json == "-":
            json.dump(report, sys.stdout, indent=2)
            print()
        else:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
            log(f"raw timings written to {args.json}")
    failed = [r for r in rows if r.error and not r.system.startswith("ray RDT")]
    for row in failed:
        log(f"FAILED: w{row.workload} {row.system} @ {row.param}: {row.error}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
