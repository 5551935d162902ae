"""How fast does one tensor move actor -> actor, end to end?

Side by side in one embedded Ray session: raydirect's transports (auto, cma,
shm, tcp), Ray's object store, Ray's built-in RDT over Gloo, and two
in-process copy floors. See benchmarks/README.md for what each row means.

    .venv/bin/python benchmarks/bench.py [--sizes 1MiB,64MiB,512MiB] [--repeats N]
                                         [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import ray
import torch

import raydirect as rd

# ---------------------------------------------------------------- constants

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
GB = 1e9  # rates are decimal GB/s: bytes / seconds / 1e9

DEFAULT_SIZES = "1MiB,64MiB,512MiB"
QUICK_SIZES = "1MiB,64MiB"
DEFAULT_REPEATS = 5
LARGE_REPEATS = 3  # for sizes >= LARGE_SIZE_BYTES, to keep a full run short
LARGE_SIZE_BYTES = 512 * MIB
QUICK_REPEATS = 2

# Ray: generous CPUs so the 0-CPU actors (and Ray's own helpers) always schedule.
RAY_NUM_CPUS = 8
ACTOR_NUM_CPUS = 0
# Both sides (driver floors and every worker) get PyTorch's huge-page allocator.
THP_ENV_VAR = "THP_MEM_ALLOC_ENABLE"
THP_ENV = {THP_ENV_VAR: "1"}
# Ray workers run torch with one thread; the in-process floors do the same.
FLOOR_TORCH_THREADS = 1

# Payload: int32 elements, element i of a transfer holds i + seed.
DTYPE = torch.int32
ELEMENT_BYTES = 4
SEED_START = 1
SEED_STEP = 7919  # a new seed per transfer: a stale buffer fails the check
SEED_LIMIT = 1 << 30  # seeds stay below this ...
MAX_SIZE_BYTES = 2 * GIB  # ... and sizes below this, so i + seed fits in int32
SAMPLE_COUNT = 64  # random elements compared one by one
STRIDED_ELEMENTS = 4096  # elements in the strided slice whose sum is compared

TRANSFER_TIMEOUT_S = 180.0  # one end-to-end transfer
SETUP_TIMEOUT_S = 180.0  # actor start, allocation, group creation
FREE_TIMEOUT_S = 60.0  # producer waits this long for its previous object to be freed

OBJECT_STORE = "ray object store"
RDT_GLOO = "ray RDT gloo"
RAYDIRECT_TRANSPORTS = ("auto", "cma", "shm", "tcp", "gloo")
RAYDIRECT_GROUP = "bench-raydirect"
FLOOR_FRESH = "floor: copy into fresh torch.empty"
FLOOR_REUSED = "floor: copy into reused memory"
GROUPS = ("raydirect", "object-store", "rdt", "floors")

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_SIZE_UNITS = {"": 1, "b": 1, "kib": KIB, "mib": MIB, "gib": GIB}


def raydirect_system(transport: str) -> str:
    return f"raydirect {transport}"


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- payload pattern


def fill_pattern(tensor: torch.Tensor, seed: int) -> None:
    """Write element i = i + seed into ``tensor`` (1-d int32), in place."""
    torch.arange(seed, seed + tensor.numel(), dtype=DTYPE, out=tensor)


def check_pattern(tensor: Any, seed: int, nbytes: int) -> None:
    """Raise ValueError unless ``tensor`` holds the pattern of ``seed``: its size,
    ``SAMPLE_COUNT`` random elements plus both ends, and the sum of a strided slice."""
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != DTYPE or tensor.dim() != 1:
        raise ValueError(f"expected a 1-d {DTYPE} tensor, got {type(tensor).__name__}")
    n = tensor.numel()
    if n * ELEMENT_BYTES != nbytes:
        raise ValueError(f"expected {nbytes} bytes, got {n * ELEMENT_BYTES}")
    gen = torch.Generator().manual_seed(seed)
    idx = torch.cat([torch.tensor([0, n - 1]), torch.randint(0, n, (SAMPLE_COUNT,), generator=gen)])
    got = tensor[idx].to(torch.int64)
    expected = idx + seed
    bad = (got != expected).nonzero().flatten()
    if bad.numel():
        i = int(idx[bad[0]])
        raise ValueError(
            f"wrong contents: {bad.numel()}/{idx.numel()} sampled elements differ, e.g. "
            f"element {i} is {int(got[bad[0]])}, expected {i + seed} (seed {seed})"
        )
    stride = max(1, n // STRIDED_ELEMENTS)
    last = (n - 1) // stride  # the slice holds elements 0, stride, ..., last * stride
    expected_sum = (last + 1) * seed + stride * last * (last + 1) // 2
    got_sum = int(tensor[::stride].sum(dtype=torch.int64))
    if got_sum != expected_sum:
        raise ValueError(
            f"wrong contents: strided sum {got_sum}, expected {expected_sum} (seed {seed})"
        )


def seeds() -> Iterator[int]:
    """A different seed for every transfer of the run."""
    seed = SEED_START
    while True:
        yield seed
        seed = (seed + SEED_STEP) % SEED_LIMIT or SEED_START


# ---------------------------------------------------------------- actors


class PatternSource:
    """Producer state: one preallocated tensor, rewritten before each transfer
    (outside the timed region) so every transfer carries fresh bytes."""

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None

    def allocate(self, nbytes: int) -> int:
        self.tensor = None  # drop the previous size first
        self.tensor = torch.empty(nbytes // ELEMENT_BYTES, dtype=DTYPE)
        fill_pattern(self.tensor, 0)  # touch every page now, not in a timed region
        return nbytes

    def current(self) -> torch.Tensor:
        assert self.tensor is not None, "allocate() first"
        return self.tensor

    def wait_free(self) -> None:
        """Block until no earlier object still refers to ``self.tensor``."""

    def prepare(self, seed: int) -> int:
        tensor = self.current()
        self.wait_free()
        fill_pattern(tensor, seed)
        return seed


@ray.remote(num_cpus=ACTOR_NUM_CPUS)
class RaydirectProducer(PatternSource):
    """Returns its tensor through raydirect: one method per transport."""

    def wait_free(self) -> None:
        if self.tensor is not None:
            rd.wait_tensor_freed(self.tensor, timeout=FREE_TIMEOUT_S)

    @rd.method(tensor_transport="auto")
    def make_auto(self) -> torch.Tensor:
        return self.current()

    @rd.method(tensor_transport="cma")
    def make_cma(self) -> torch.Tensor:
        return self.current()

    @rd.method(tensor_transport="shm")
    def make_shm(self) -> torch.Tensor:
        return self.current()

    @rd.method(tensor_transport="tcp")
    def make_tcp(self) -> torch.Tensor:
        return self.current()

    @rd.method(tensor_transport="gloo")
    def make_gloo(self) -> torch.Tensor:
        return self.current()

    def stats(self) -> dict[str, Any]:
        return asdict(rd.local_stats())


@ray.remote(num_cpus=ACTOR_NUM_CPUS)
class ObjectStoreProducer(PatternSource):
    """A plain Ray actor: the returned tensor is serialized into the object store."""

    def make(self) -> torch.Tensor:
        return self.current()


@ray.remote(num_cpus=ACTOR_NUM_CPUS)
class RdtProducer(PatternSource):
    """Ray's built-in RDT: the tensor stays here and moves over a Gloo group."""

    def wait_free(self) -> None:
        if self.tensor is not None:
            # Ray logs a "DeprecationWarning: `ray.worker.global_worker`" line here
            # once: its own wait_tensor_freed uses that name.
            from ray.experimental import wait_tensor_freed

            wait_tensor_freed(self.tensor, timeout=FREE_TIMEOUT_S)

    @ray.method(tensor_transport="gloo")
    def make(self) -> torch.Tensor:
        return self.current()


class CheckingConsumer:
    """Receives the tensor as a task argument, checks it cheaply, drops it."""

    def consume(self, tensor: Any, seed: int, nbytes: int) -> int:
        check_pattern(tensor, seed, nbytes)
        return nbytes

    def stats(self) -> dict[str, Any]:
        return asdict(rd.local_stats())


@ray.remote(num_cpus=ACTOR_NUM_CPUS)
class Consumer(CheckingConsumer):
    """The consumer of the raydirect and object-store rows."""


# RDT receives on a system concurrency group that Ray adds only when the class
# is declared with enable_tensor_transport=True: ``.options(...)`` on a plain
# class does not add it, and the transfer then deadlocks behind ``consume``.
@ray.remote(num_cpus=ACTOR_NUM_CPUS, enable_tensor_transport=True)  # type: ignore[call-overload]
class RdtConsumer(CheckingConsumer):
    """The consumer of the RDT row."""


# ---------------------------------------------------------------- measurement


@dataclass
class Row:
    """All timings of one system at one size."""

    system: str
    size_bytes: int
    cold_s: float | None = None  # the first (warm-up) transfer
    times_s: list[float] = field(default_factory=list)  # steady-state repeats
    error: str | None = None

    def gbps(self) -> list[float]:
        return [self.size_bytes / t / GB for t in self.times_s]

    def median_gbps(self) -> float | None:
        rates = self.gbps()
        return statistics.median(rates) if rates and self.error is None else None


def time_transfers(
    system: str,
    nbytes: int,
    repeats: int,
    transfer: Callable[[int], float],
    seed_iter: Iterator[int],
) -> Row:
    """One cold transfer, then ``repeats`` timed ones; ``transfer(seed)`` returns seconds.
    A failure ends the row and is recorded in it."""
    row = Row(system, nbytes)
    try:
        for i in range(repeats + 1):
            seconds = transfer(next(seed_iter))
            if i == 0:
                row.cold_s = seconds
            else:
                row.times_s.append(seconds)
    except Exception as exc:  # report the row as n/a and go on with the others
        row.error = describe_error(exc)
        log(f"{system} @ {format_size(nbytes)} FAILED: {row.error}")
    else:
        median = row.median_gbps()
        log(f"{system} @ {format_size(nbytes)}: median {median:.2f} GB/s")
    return row


def actor_transfer(
    producer: Any, make: Callable[[], Any], consumer: Any, nbytes: int
) -> Callable[[int], float]:
    """A transfer function: rewrite the producer's tensor (untimed), then time
    ``consumer.consume(make())`` from the driver."""

    def transfer(seed: int) -> float:
        ray.get(producer.prepare.remote(seed), timeout=SETUP_TIMEOUT_S)
        t0 = time.perf_counter()
        got = ray.get(consumer.consume.remote(make(), seed, nbytes), timeout=TRANSFER_TIMEOUT_S)
        seconds = time.perf_counter() - t0
        if got != nbytes:
            raise ValueError(f"consumer reported {got} bytes, expected {nbytes}")
        return seconds

    return transfer


@contextmanager
def actor_pair(producer_cls: Any, consumer_cls: Any) -> Iterator[tuple[Any, Any]]:
    """A started producer and consumer, killed on exit."""
    producer = producer_cls.remote()
    consumer = consumer_cls.remote()
    try:
        ray.get(
            [producer.__ray_ready__.remote(), consumer.__ray_ready__.remote()],
            timeout=SETUP_TIMEOUT_S,
        )
        yield producer, consumer
    finally:
        for actor in (producer, consumer):
            ray.kill(actor)


def time_pair(
    producer: Any,
    consumer: Any,
    systems: Sequence[tuple[str, str]],
    sizes: Sequence[int],
    repeats: Callable[[int], int],
    seed_iter: Iterator[int],
) -> list[Row]:
    """For each size: size the producer's tensor, then time each (system, producer
    method) in turn. A setup failure marks that size's rows n/a."""
    rows: list[Row] = []
    for nbytes in sizes:
        try:
            ray.get(producer.allocate.remote(nbytes), timeout=SETUP_TIMEOUT_S)
        except Exception as exc:
            reason = f"producer setup failed: {describe_error(exc)}"
            log(f"{format_size(nbytes)}: {reason}")
            rows += [Row(system, nbytes, error=reason) for system, _ in systems]
            continue
        for system, method_name in systems:
            make = getattr(producer, method_name).remote
            transfer = actor_transfer(producer, make, consumer, nbytes)
            rows.append(time_transfers(system, nbytes, repeats(nbytes), transfer, seed_iter))
    return rows


def bench_raydirect(
    sizes: Sequence[int], repeats: Callable[[int], int], seed_iter: Iterator[int]
) -> list[Row]:
    """How fast does raydirect move one tensor producer actor -> consumer actor,
    per transport (auto, cma, shm, tcp, gloo), end to end as seen by the driver?"""
    systems = [(raydirect_system(t), f"make_{t}") for t in RAYDIRECT_TRANSPORTS]
    log("raydirect: starting producer and consumer")
    with actor_pair(RaydirectProducer, Consumer) as (producer, consumer):
        # gloo needs both in a collective group (the others ignore it).
        rd.create_collective_group([producer, consumer], backend="gloo", name=RAYDIRECT_GROUP)
        rows = time_pair(producer, consumer, systems, sizes, repeats, seed_iter)
        rd.destroy_collective_group(RAYDIRECT_GROUP)
        try:  # after the last object is freed, nothing should be held
            ray.get(producer.prepare.remote(SEED_START), timeout=SETUP_TIMEOUT_S)
            log(f"raydirect producer stats: {ray.get(producer.stats.remote())}")
            log(f"raydirect consumer stats: {ray.get(consumer.stats.remote())}")
        except Exception as exc:
            log(f"raydirect: stats unavailable: {describe_error(exc)}")
    return rows


def bench_object_store(
    sizes: Sequence[int], repeats: Callable[[int], int], seed_iter: Iterator[int]
) -> list[Row]:
    """How fast does Ray's object store move one tensor returned by a plain
    actor method to another actor that takes it as an argument?"""
    log("object store: starting producer and consumer")
    with actor_pair(ObjectStoreProducer, Consumer) as (producer, consumer):
        return time_pair(producer, consumer, [(OBJECT_STORE, "make")], sizes, repeats, seed_iter)


def bench_rdt_gloo(
    sizes: Sequence[int], repeats: Callable[[int], int], seed_iter: Iterator[int]
) -> list[Row]:
    """How fast does Ray's built-in RDT (``@ray.method(tensor_transport="gloo")``
    over a Gloo collective group) move one tensor actor -> actor?"""
    try:
        from ray.experimental.collective import (
            create_collective_group,
            destroy_collective_group,
        )
    except ImportError as exc:
        return [Row(RDT_GLOO, n, error=f"ImportError: {exc}") for n in sizes]
    log("RDT gloo: starting producer and consumer")
    with actor_pair(RdtProducer, RdtConsumer) as (producer, consumer):
        log("RDT gloo: creating the collective group")
        try:
            group = create_collective_group([producer, consumer], backend="torch_gloo")
        except Exception as exc:
            reason = f"create_collective_group failed: {describe_error(exc)}"
            log(f"RDT gloo: {reason}")
            return [Row(RDT_GLOO, n, error=reason) for n in sizes]
        try:
            return time_pair(producer, consumer, [(RDT_GLOO, "make")], sizes, repeats, seed_iter)
        finally:
            try:
                destroy_collective_group(group)
            except Exception as exc:  # e.g. RDT already tore it down after a failure
                log(f"RDT gloo: destroy_collective_group: {describe_error(exc)}")


def time_floor(system: str, nbytes: int, repeats: int, copy: Callable[[torch.Tensor], None]) -> Row:
    """Time ``copy(src)`` in this process: one cold call, then ``repeats``."""
    src = torch.empty(nbytes // ELEMENT_BYTES, dtype=DTYPE)
    fill_pattern(src, SEED_START)

    def transfer(seed: int) -> float:
        t0 = time.perf_counter()
        copy(src)
        return time.perf_counter() - t0

    return time_transfers(system, nbytes, repeats, transfer, seeds())


def bench_floors(sizes: Sequence[int], repeats: Callable[[int], int]) -> list[Row]:
    """What do the copies an actor -> actor transfer cannot avoid cost in one
    process: one copy into a freshly allocated ``torch.empty`` (page faults
    included), and one copy into memory already touched?"""
    rows: list[Row] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(FLOOR_TORCH_THREADS)
    try:
        for nbytes in sizes:

            def copy_fresh(src: torch.Tensor) -> None:
                dst = torch.empty_like(src)
                dst.copy_(src)
                del dst

            reused = torch.empty(nbytes // ELEMENT_BYTES, dtype=DTYPE)
            fill_pattern(reused, 0)  # touched once, before any timing

            def copy_reused(src: torch.Tensor, dst: torch.Tensor = reused) -> None:
                dst.copy_(src)

            rows.append(time_floor(FLOOR_FRESH, nbytes, repeats(nbytes), copy_fresh))
            rows.append(time_floor(FLOOR_REUSED, nbytes, repeats(nbytes), copy_reused))
            del reused
    finally:
        torch.set_num_threads(threads)
    return rows


# ---------------------------------------------------------------- report


def first_line(text: str) -> str:
    text = _ANSI.sub("", text).strip()
    return text.splitlines()[0] if text else "(no message)"


def describe_error(exc: BaseException) -> str:
    """One line naming the real error (a remote task's cause rather than Ray's wrapper)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    return f"{type(exc).__name__}: {first_line(str(exc))}"


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]iB|B)?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: write e.g. 1MiB, 64MiB, 4096")
    nbytes = int(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").lower()]
    if nbytes <= 0 or nbytes % ELEMENT_BYTES or nbytes > MAX_SIZE_BYTES:
        raise argparse.ArgumentTypeError(
            f"size {text!r} must be a positive multiple of {ELEMENT_BYTES} bytes, "
            f"at most {format_size(MAX_SIZE_BYTES)}"
        )
    return nbytes


def format_size(nbytes: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def machine_facts() -> dict[str, Any]:
    thp = "unknown"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "raydirect": rd.__version__,
        "transparent_hugepage": thp,
        "worker_env": THP_ENV,
    }


def ratio(row: Row, baseline: Row | None) -> str:
    mine = row.median_gbps()
    base = baseline.median_gbps() if baseline else None
    if mine is None or not base:
        return "-"
    return f"{mine / base:.2f}x"


def render_table(rows: list[Row]) -> str:
    headers = [
        "size",
        "system",
        "median GB/s",
        "min-max GB/s",
        "cold GB/s",
        "vs object store",
        "vs RDT gloo",
    ]
    lines: list[list[str]] = []
    baselines = {(r.system, r.size_bytes): r for r in rows}
    for row in rows:
        size = format_size(row.size_bytes)
        if row.error is not None:
            lines.append([size, row.system, f"n/a: {row.error}", "", "", "", ""])
            continue
        rates = row.gbps()
        cold = f"{row.size_bytes / row.cold_s / GB:.2f}" if row.cold_s else "-"
        lines.append(
            [
                size,
                row.system,
                f"{row.median_gbps():.2f}",
                f"{min(rates):.2f}-{max(rates):.2f}",
                cold,
                ratio(row, baselines.get((OBJECT_STORE, row.size_bytes))),
                ratio(row, baselines.get((RDT_GLOO, row.size_bytes))),
            ]
        )
    # An n/a message sets no column width: its row is left unaligned.
    widths = [
        max([len(h)] + [len(line[i]) for line in lines if not line[2].startswith("n/a")])
        for i, h in enumerate(headers)
    ]

    def fmt(cells: list[str]) -> str:
        if cells[2].startswith("n/a"):
            padded = [cells[0].ljust(widths[0]), cells[1].ljust(widths[1]), *cells[2:]]
        else:
            padded = [
                c.ljust(w) if i < 2 else c.rjust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            ]
        return "| " + " | ".join(padded) + " |"

    # Markdown: text columns left-aligned, numbers right-aligned.
    rule = (
        "|"
        + "|".join("-" * (w + 2) if i < 2 else "-" * (w + 1) + ":" for i, w in enumerate(widths))
        + "|"
    )
    return "\n".join([fmt(headers), rule, *(fmt(line) for line in lines)])


def order_rows(rows: list[Row], sizes: Sequence[int]) -> list[Row]:
    systems = [raydirect_system(t) for t in RAYDIRECT_TRANSPORTS]
    systems += [OBJECT_STORE, RDT_GLOO, FLOOR_FRESH, FLOOR_REUSED]
    rank = {s: i for i, s in enumerate(systems)}
    size_rank = {n: i for i, n in enumerate(sizes)}
    return sorted(rows, key=lambda r: (size_rank[r.size_bytes], rank.get(r.system, len(rank))))


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", help=f"comma-separated sizes (default {DEFAULT_SIZES})")
    parser.add_argument(
        "--repeats",
        type=int,
        help=f"timed transfers per system and size after one cold one (default "
        f"{DEFAULT_REPEATS}, {LARGE_REPEATS} for sizes >= {format_size(LARGE_SIZE_BYTES)})",
    )
    parser.add_argument("--json", metavar="PATH", help="write all raw timings here")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"sizes {QUICK_SIZES} and {QUICK_REPEATS} repeats (unless given explicitly)",
    )
    parser.add_argument(
        "--groups",
        default=",".join(GROUPS),
        help=f"which groups of rows to run (default all: {','.join(GROUPS)})",
    )
    args = parser.parse_args(argv)
    sizes_text = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    try:
        args.size_list = [parse_size(s) for s in sizes_text.split(",") if s.strip()]
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    args.group_list = [g.strip() for g in args.groups.split(",") if g.strip()]
    unknown = set(args.group_list) - set(GROUPS)
    if unknown:
        parser.error(f"unknown group(s) {sorted(unknown)}; choose from {GROUPS}")
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)

    def repeats(nbytes: int) -> int:
        if args.repeats is not None:
            return args.repeats
        if args.quick:
            return QUICK_REPEATS
        return LARGE_REPEATS if nbytes >= LARGE_SIZE_BYTES else DEFAULT_REPEATS

    # PyTorch reads this on its first large allocation: set before any, so the
    # in-process floors get the same allocator as the workers.
    os.environ.update(THP_ENV)
    facts = machine_facts()
    header = (
        f"# {facts['cores']} cores, torch {facts['torch']}, ray {facts['ray']}, raydirect "
        f"{facts['raydirect']}, python {facts['python']}, kernel {facts['kernel']}, THP "
        f"{facts['transparent_hugepage']}, {THP_ENV_VAR}=1 in driver and workers"
    )
    log(header.removeprefix("# "))
    started = time.perf_counter()
    ray.init(
        num_cpus=RAY_NUM_CPUS,
        include_dashboard=False,
        runtime_env={"env_vars": THP_ENV},
        logging_level=logging.WARNING,
    )
    rows: list[Row] = []
    seed_iter = seeds()
    try:
        if "raydirect" in args.group_list:
            rows += bench_raydirect(args.size_list, repeats, seed_iter)
        if "object-store" in args.group_list:
            rows += bench_object_store(args.size_list, repeats, seed_iter)
        if "rdt" in args.group_list:
            rows += bench_rdt_gloo(args.size_list, repeats, seed_iter)
        if "floors" in args.group_list:
            log("floors: in-process copies")
            rows += bench_floors(args.size_list, repeats)
    finally:
        ray.shutdown()
    elapsed = time.perf_counter() - started
    rows = order_rows(rows, args.size_list)
    print(header)
    print(render_table(rows))
    print(
        f"# {elapsed:.0f} s in all; GB/s = bytes / seconds / 1e9; median over repeats, "
        "cold = first transfer of that system and size"
    )
    if args.json:
        report = {
            "machine": facts,
            "config": {
                "sizes": args.size_list,
                "repeats": {format_size(n): repeats(n) for n in args.size_list},
                "dtype": str(DTYPE),
                "ray_num_cpus": RAY_NUM_CPUS,
                "floor_torch_threads": FLOOR_TORCH_THREADS,
            },
            "elapsed_s": elapsed,
            "rows": [{**asdict(r), "median_gbps": r.median_gbps(), "gbps": r.gbps()} for r in rows],
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        log(f"raw timings written to {args.json}")
    return 1 if any(r.error for r in rows if r.system != RDT_GLOO) else 0


if __name__ == "__main__":
    sys.exit(main())
