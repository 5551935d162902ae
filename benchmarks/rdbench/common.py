"""Shared pieces of the benchmark: constants, the payload pattern and its
checks, the state-dict layout, rows and timing, progress lines, sizes."""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
GB = 1e9  # rates are decimal GB/s: bytes / seconds / 1e9
US = 1e-6

# Payload: int32 elements; element i of a tensor holds i + its seed.
DTYPE = torch.int32
ELEMENT_BYTES = 4
SEED_START = 1
SEED_STEP = 7919  # a new seed per transfer: a stale buffer fails the check
PART_STEP = 104729  # tensor k of a transfer gets seed + k * PART_STEP: a swapped tensor fails
SEED_LIMIT = 1 << 30  # seeds stay below this ...
MAX_SIZE_BYTES = 2 * GIB  # ... and tensors below this, so i + seed fits in int32
SAMPLE_COUNT = 64  # random elements compared one by one
STRIDED_ELEMENTS = 4096  # elements in the strided slice whose sum is compared
FULL_CHECK_ELEMENTS = 16 * KIB  # tensors up to this many elements are compared whole

LARGE_REPEATS_FROM = 512 * MIB  # a full run repeats operations moving this much fewer times

TRANSFER_TIMEOUT_S = 180.0  # one end-to-end transfer
SETUP_TIMEOUT_S = 180.0  # actor start, allocation, group creation
FREE_TIMEOUT_S = 60.0  # producer waits this long for its previous object to be freed

# Ray: generous CPUs so the 0-CPU actors (and Ray's own helpers) always schedule.
RAY_NUM_CPUS = 8
ACTOR_NUM_CPUS = 0
# Both sides (driver floors and every worker) get PyTorch's huge-page allocator.
THP_ENV_VAR = "THP_MEM_ALLOC_ENABLE"
THP_ENV = {THP_ENV_VAR: "1"}
MALLOC_HUGE_PAGES = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


# System names shared by the workloads, the table and the ratios.
OBJECT_STORE = "ray object store"
PLAIN_CALL = "ray actor call"  # a plain method, no raydirect: the value inline in the reply
RDT_GLOO = "ray RDT gloo"
RDT_NIXL = "ray RDT nixl"
FLOOR_FRESH = "floor: copy into fresh torch.empty"
FLOOR_REUSED = "floor: copy into reused memory"

# --groups: which families of rows run.
GROUP_RAYDIRECT = "raydirect"
GROUP_RAY = "object-store"  # Ray without RDT: the object store and plain actor calls
GROUP_RDT = "rdt"
GROUP_FLOORS = "floors"
# NIXL rows (raydirect's and Ray RDT's) run only when asked for, in a run of
# their own: every process where Ray's RDT starts a NIXL agent keeps a progress
# thread polling without pause for its whole life (NIXL's Python API fixes the
# delay at 0; raydirect sets it), which would take cores from every later row.
GROUP_NIXL = "nixl"
GROUPS = (GROUP_RAYDIRECT, GROUP_RAY, GROUP_RDT, GROUP_FLOORS, GROUP_NIXL)
DEFAULT_GROUPS = (GROUP_RAYDIRECT, GROUP_RAY, GROUP_RDT, GROUP_FLOORS)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_SIZE_UNITS = {"": 1, "b": 1, "kib": KIB, "mib": MIB, "gib": GIB}
_STARTED = time.perf_counter()

Layout = dict[str, tuple[int, ...]]  # tensor name -> shape (int32 elements)


def raydirect_system(transport: str) -> str:
    return f"raydirect {transport}"


def log(message: str) -> None:
    """A progress line on stderr: wall clock and seconds since the run began."""
    elapsed = time.perf_counter() - _STARTED
    stamp = time.strftime("%H:%M:%S")
    print(f"[bench {stamp} +{elapsed:5.0f}s] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- payload pattern


def huge_page_bytes(pid: int | str = "self") -> int:
    """Bytes of process ``pid``'s memory on transparent huge pages (smaps_rollup)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return int(fields["AnonHugePages"].split()[0]) * 1024


class StandIn:
    """What a raydirect Payload is to Ray, without raydirect: an object of an
    importable class, pickled by reference (Ray's pickle path, not its msgpack
    one for an int or bytes), about a 1 MiB ``reads=1`` Payload's size (531
    bytes pickled). Workload 13's floor returns one."""

    def __init__(self, seed: int, pad: bytes = b"\x5a" * 512) -> None:
        self.seed, self.pad = seed, pad

    def __reduce__(self) -> tuple[Any, ...]:
        return (StandIn, (self.seed, self.pad))


def fill_pattern(tensor: torch.Tensor, seed: int) -> None:
    """Write element i = i + seed into ``tensor`` (contiguous int32), in place."""
    flat = tensor.view(-1)
    torch.arange(seed, seed + flat.numel(), dtype=DTYPE, out=flat)


def check_pattern(
    tensor: Any,
    seed: int,
    nbytes: int,
    samples: int = SAMPLE_COUNT,
    strided: int = STRIDED_ELEMENTS,
) -> None:
    """Raise ValueError unless ``tensor`` holds the pattern of ``seed``: its size,
    both ends, ``samples`` random elements, and the sum of a strided slice of
    about ``strided`` elements (a stale, shifted or short buffer fails). Tensors
    of up to ``FULL_CHECK_ELEMENTS`` elements are compared whole."""
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != DTYPE:
        raise ValueError(f"expected a {DTYPE} tensor, got {type(tensor).__name__}")
    flat = tensor.reshape(-1)
    n = flat.numel()
    if n * ELEMENT_BYTES != nbytes:
        raise ValueError(f"expected {nbytes} bytes, got {n * ELEMENT_BYTES}")
    if n <= FULL_CHECK_ELEMENTS:
        expected_all = torch.arange(seed, seed + n, dtype=DTYPE)
        if not torch.equal(flat, expected_all):
            i = int((flat != expected_all).nonzero()[0])
            raise ValueError(
                f"wrong contents: element {i} is {int(flat[i])}, expected {i + seed} (seed {seed})"
            )
        return
    for i in (0, n - 1):  # both ends
        if int(flat[i]) != i + seed:
            raise ValueError(
                f"wrong contents: element {i} is {int(flat[i])}, expected {i + seed} (seed {seed})"
            )
    if samples:
        gen = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, n, (samples,), generator=gen)
        got = flat[idx].to(torch.int64)
        bad = (got != idx + seed).nonzero().flatten()
        if bad.numel():
            i = int(idx[bad[0]])
            raise ValueError(
                f"wrong contents: {bad.numel()}/{samples} sampled elements differ, e.g. "
                f"element {i} is {int(got[bad[0]])}, expected {i + seed} (seed {seed})"
            )
    stride = max(1, n // strided)
    last = (n - 1) // stride  # the slice holds elements 0, stride, ..., last * stride
    expected_sum = (last + 1) * seed + stride * last * (last + 1) // 2
    got_sum = int(flat[::stride].sum(dtype=torch.int64))
    if got_sum != expected_sum:
        raise ValueError(
            f"wrong contents: strided sum {got_sum}, expected {expected_sum} (seed {seed})"
        )


def part_seed(seed: int, k: int) -> int:
    """The seed of tensor ``k`` of a transfer whose seed is ``seed``."""
    return (seed + k * PART_STEP) % SEED_LIMIT


def fill_layout(tensors: Mapping[str, torch.Tensor], seed: int) -> None:
    for k, tensor in enumerate(tensors.values()):
        fill_pattern(tensor, part_seed(seed, k))


def check_layout(value: Any, layout: Layout, seed: int) -> int:
    """Check a received dict against ``layout`` and ``seed``; return its bytes.
    Each tensor: its shape, both ends and a strided sum (small ones whole): 5-10 ms
    for 200 tensors here, small beside moving 256 MiB."""
    if not isinstance(value, Mapping) or list(value) != list(layout):
        got = list(value)[:3] if isinstance(value, Mapping) else type(value).__name__
        raise ValueError(f"expected a dict with keys {list(layout)[:3]}..., got {got}")
    total = 0
    for k, (name, shape) in enumerate(layout.items()):
        tensor = value[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {shape}")
        nbytes = math.prod(shape) * ELEMENT_BYTES
        try:
            check_pattern(tensor, part_seed(seed, k), nbytes, samples=0, strided=256)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        total += nbytes
    return total


def layout_bytes(layout: Layout) -> int:
    return sum(math.prod(shape) for shape in layout.values()) * ELEMENT_BYTES


VOCAB_PAD = 64  # the embedding's rows, a multiple of this (engines pad the vocabulary)


def state_dict_layout(total_bytes: int, layers: int = 22) -> Layout:
    """A decoder-only transformer's state dict (Llama-like names and proportions:
    embedding, per layer two norms, q/k/v/o with 4x grouped k/v, gate/up/down
    MLP of 2.75x width, a final norm): ``layers * 9 + 2`` tensors (200 by default)
    from 1 KiB norms to a ~20 MiB embedding, summing to ``total_bytes`` less what
    padding the vocabulary to a multiple of 64 leaves over (under 64 embedding
    rows), as engines pad it so that every tensor-parallel rank holds an equal
    share. The width is the largest power of two that leaves the embedding >= 5%."""
    elements = total_bytes // ELEMENT_BYTES
    if total_bytes % ELEMENT_BYTES:
        raise ValueError(f"state size {total_bytes} is not a multiple of {ELEMENT_BYTES}")

    def per_layer(d: int) -> int:
        f = d * 11 // 4
        return 2 * d + 2 * d * d + 2 * d * (d // 4) + 3 * d * f

    d = 1 << 14
    while d > 8 and layers * per_layer(d) + d > 0.95 * elements:
        d //= 2
    vocab = (elements - layers * per_layer(d) - d) // d
    vocab -= vocab % VOCAB_PAD
    if vocab < VOCAB_PAD:
        raise ValueError(
            f"state size {format_size(total_bytes)} does not split into {layers} layers; "
            "use a multiple of 64 KiB of at least 1 MiB"
        )
    f = d * 11 // 4
    layout: Layout = {"model.embed_tokens.weight": (vocab, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        layout[p + "input_layernorm.weight"] = (d,)
        layout[p + "self_attn.q_proj.weight"] = (d, d)
        layout[p + "self_attn.k_proj.weight"] = (d // 4, d)
        layout[p + "self_attn.v_proj.weight"] = (d // 4, d)
        layout[p + "self_attn.o_proj.weight"] = (d, d)
        layout[p + "post_attention_layernorm.weight"] = (d,)
        layout[p + "mlp.gate_proj.weight"] = (f, d)
        layout[p + "mlp.up_proj.weight"] = (f, d)
        layout[p + "mlp.down_proj.weight"] = (d, f)
    layout["model.norm.weight"] = (d,)
    assert total_bytes - VOCAB_PAD * d * ELEMENT_BYTES < layout_bytes(layout) <= total_bytes
    return layout


def seeds() -> Iterator[int]:
    """A different seed for every transfer of the run."""
    seed = SEED_START
    while True:
        yield seed
        seed = (seed + SEED_STEP) % SEED_LIMIT or SEED_START


# ---------------------------------------------------------------- rows and timing


@dataclass
class Row:
    """All timings of one system at one point (size, consumer count, ...) of a workload.

    ``unit`` is ``"GB/s"`` (rate = ``nbytes`` / seconds) or ``"us"`` (microseconds
    per operation, lower is better). ``cold_s`` is the first timed operation,
    ``times_s`` the steady-state ones after it. ``error`` is a failure;
    ``skipped`` a reason the row cannot run here (not installed, not supported)."""

    workload: int
    system: str
    param: str
    x: float  # numeric position of ``param``: bytes, consumers, ... (ordering, plots)
    nbytes: int
    unit: str = "GB/s"
    cold_s: float | None = None
    times_s: list[float] = field(default_factory=list)
    error: str | None = None
    skipped: str | None = None
    note: str = ""
    # What else the row measured beside times (workload 7: each worker's bytes
    # received over the bytes of its slice), by name.
    measured: dict[str, float] = field(default_factory=dict)
    # The values behind a measured figure, one per operation, by name (workload 9:
    # each streamed update's stall, in seconds); in the JSON report.
    samples: dict[str, list[float]] = field(default_factory=dict)

    def values(self) -> list[float]:
        if self.unit == "us":
            return [t / US for t in self.times_s]
        return [self.nbytes / t / GB for t in self.times_s]

    def cold_value(self) -> float | None:
        if not self.cold_s:
            return None
        return self.cold_s / US if self.unit == "us" else self.nbytes / self.cold_s / GB

    def median(self) -> float | None:
        vals = self.values()
        return statistics.median(vals) if vals and self.error is None else None

    def as_json(self) -> dict[str, Any]:
        vals = self.values()
        return {
            "workload": self.workload,
            "system": self.system,
            "param": self.param,
            "x": self.x,
            "nbytes": self.nbytes,
            "unit": self.unit,
            "cold_s": self.cold_s,
            "times_s": self.times_s,
            "median": self.median(),
            "min": min(vals) if vals else None,
            "max": max(vals) if vals else None,
            "cold": self.cold_value(),
            "error": self.error,
            "skipped": self.skipped,
            "note": self.note,
            "measured": self.measured,
            "samples": self.samples,
        }


@dataclass(frozen=True)
class Workload:
    """One workload: its number and title, what its rows vary (``param_header``),
    its unit, the systems its ratio columns divide by, the function that runs it,
    and optionally one that summarises its rows (markdown, after its table)."""

    number: int
    title: str
    param_header: str
    unit: str
    baselines: tuple[str, ...]
    run: Callable[[Any], list[Row]]
    summary: Callable[[Sequence[Row]], str] | None = None


def run_row(
    row: Row, repeats: int, operation: Callable[[int], float], seed_iter: Iterator[int]
) -> Row:
    """Fill ``row``: one cold ``operation(seed)``, then ``repeats`` more; each returns
    seconds. A failure ends the row and is recorded in it."""
    where = f"w{row.workload} {row.system} @ {row.param}"
    log(f"{where}: running (1 cold + {repeats})")
    try:
        for i in range(repeats + 1):
            seconds = operation(next(seed_iter))
            if i == 0:
                row.cold_s = seconds
            else:
                row.times_s.append(seconds)
    except Exception as exc:  # report the row as n/a and go on with the others
        row.error = describe_error(exc)
        log(f"{where}: FAILED: {row.error}")
    else:
        log(f"{where}: median {row.median():.2f} {row.unit}")
    return row


def fail_rows(rows: Sequence[Row], reason: str) -> list[Row]:
    for row in rows:
        row.error = reason
    return list(rows)


# ---------------------------------------------------------------- text


def first_line(text: str) -> str:
    text = _ANSI.sub("", text).strip()
    return text.splitlines()[0] if text else "(no message)"


def describe_error(exc: BaseException) -> str:
    """One line naming the real error (a remote task's cause rather than Ray's wrapper)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    return f"{type(exc).__name__}: {first_line(str(exc))}"


def parse_size(text: str, most: int = MAX_SIZE_BYTES) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]iB|B)?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: write e.g. 1MiB, 64MiB, 4096")
    nbytes = int(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").lower()]
    if nbytes <= 0 or nbytes % ELEMENT_BYTES or nbytes > most:
        raise argparse.ArgumentTypeError(
            f"size {text!r} must be a positive multiple of {ELEMENT_BYTES} bytes, "
            f"at most {format_size(most)}"
        )
    return nbytes


def format_size(nbytes: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"
