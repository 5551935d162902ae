"""Workload 14: where one transfer's time goes, step by step, in both processes.

A profiling aid, not a comparison. Inside a producer and a consumer actor of
their own, wall-clock marks wrap raydirect's own calls, found by name
(``PRODUCER_CALLS``, ``CONSUMER_CALLS``): the marks follow the code, not an API,
and a name the code no longer has is logged and left out. Two kinds of point:

- **a medium transfer** (workload 8's, at each of ``--timeline-sizes``): the
  driver calls a producer method returning one tensor and passes the ref to a
  consumer method that takes it; the same two calls returning an int run
  alternately as the baseline;
- **a weight-sync step of the primitives** (at each of ``--timeline-tensors``:
  ``--state-size`` as 1, 200 or 5,000 tensors, workload 6's layouts): the
  producer returns its state dict from an ``@rd.method``, the consumer reads it
  with ``rd.get(ref, into=its own tensors)``.

Before each operation, untimed, the producer waits until no object holds its
tensors and writes them with a new seed, which the consumer checks. A row is one
step at one point: its times are how long the step took in each of
``--rounds`` operations after a cold one; the summary gives, per point, when
each step started and ended after the driver's call, medians. The actors run
with huge pages for large allocations, as every worker of ``raydirect bench``.
"""

from __future__ import annotations

import functools
import importlib
import statistics
import time
from collections.abc import Sequence
from typing import Any

import ray
import torch

import raydirect as rd
from rdbench.common import (
    ACTOR_NUM_CPUS,
    DTYPE,
    ELEMENT_BYTES,
    FREE_TIMEOUT_S,
    GROUP_RAYDIRECT,
    SETUP_TIMEOUT_S,
    THP_ENV,
    TRANSFER_TIMEOUT_S,
    Layout,
    Row,
    describe_error,
    format_size,
    layout_bytes,
    log,
    state_dict_layout,
)
from rdbench.fleet import Context

Mark = tuple[str, float, float]  # (step, wall-clock start, end)
Steps = dict[str, tuple[float, float]]  # one operation: step -> (start, end) after the call
# (module, attribute: a function or Class.method) of the calls marked in each role.
PRODUCER_CALLS = [
    ("raydirect._api", "export"),
    ("raydirect._producer", "export"),
    ("raydirect._producer", "split"),
    ("raydirect._producer", "_stored"),
    ("raydirect._producer", "_extract_all"),
    ("raydirect._lease", "LeasePool.take"),
    ("raydirect._payload", "Payload.__reduce__"),
    ("raydirect._payload", "InlineValue.of"),
    ("raydirect._payload", "InlineValue.__reduce__"),
]
CONSUMER_CALLS = [
    ("raydirect._api", "get_deferred"),
    ("raydirect._api", "match"),
    ("raydirect._payload", "_rebuild"),
    ("raydirect._payload", "_rebuild_inline"),
    ("raydirect._consumer", "choose_transport"),
    ("raydirect._consumer", "_slots"),
    ("raydirect._consumer", "allocate_bytes"),
    ("raydirect._consumer", "_read_bytes"),
    ("raydirect.transports.cma", "read_remote"),
    ("raydirect.transports.cma", "CmaTransport.receive"),
    ("raydirect._channel", "notify"),
    ("raydirect._consumer", "join"),
]
CALLS = "the two calls"  # the driver's whole operation, a row of its own per system
INT = "returning an int"
TENSOR = "raydirect auto"
STEP = "rd.get(into=)"  # a weight-sync step: the state dict into the consumer's tensors
STARTS, ENDS = "starts ms", "ends ms"  # a step's median start and end after the driver's call
# 5,000 tensors: workload 6's 555 decoder layers; 200: 22; 1: the embedding alone.
LAYERS = {200: 22, 5000: 555}


def layout_of(tensors: int, nbytes: int) -> Layout:
    if tensors == 1:
        return {"model.embed_tokens.weight": (nbytes // ELEMENT_BYTES // 1024, 1024)}
    return state_dict_layout(nbytes, layers=LAYERS[tensors])


class _Marks:
    """Wall-clock (start, end) of every marked call in this process, and the
    names the code no longer has."""

    def __init__(self, calls: list[tuple[str, str]]) -> None:
        self.marks: list[Mark] = []
        self.missing: list[str] = []
        for module_name, path in calls:
            owner: Any = importlib.import_module(module_name)
            *outer, name = path.split(".")
            for part in outer:
                owner = getattr(owner, part, None)
            if owner is None or not hasattr(owner, name):
                self.missing.append(f"{module_name}.{path}")
                continue
            setattr(owner, name, self._wrapped(path, getattr(owner, name)))

    def _wrapped(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def marked(*args: Any, **kwargs: Any) -> Any:
            start = time.time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.marks.append((name, start, time.time()))

        return marked

    def mark(self, name: str) -> None:
        now = time.time()
        self.marks.append((name, now, now))


@ray.remote(num_cpus=ACTOR_NUM_CPUS)
class TimedProducer:
    def __init__(self, layout: Layout) -> None:
        self.tensors = {k: torch.empty(s, dtype=DTYPE) for k, s in layout.items()}
        self.recorder = _Marks(PRODUCER_CALLS)

    def missing(self) -> list[str]:
        return self.recorder.missing

    def prepare(self, seed: int) -> None:
        for tensor in self.tensors.values():
            rd.wait_tensor_freed(tensor, timeout=FREE_TIMEOUT_S)
            tensor.fill_(seed)
        self.recorder.marks.clear()

    @rd.method
    def value(self) -> torch.Tensor:
        """A medium transfer: the one tensor."""
        self.recorder.mark("method body")
        return next(iter(self.tensors.values()))

    @rd.method
    def state(self) -> dict[str, torch.Tensor]:
        """A weight-sync step: the state dict."""
        self.recorder.mark("method body")
        return dict(self.tensors)

    def number(self) -> int:
        self.recorder.mark("method body")
        return int(next(iter(self.tensors.values())).reshape(-1)[0])

    def marks(self) -> list[Mark]:
        return self.recorder.marks


@ray.remote(num_cpus=ACTOR_NUM_CPUS)
class TimedConsumer:
    def __init__(self, layout: Layout) -> None:
        self.targets = {k: torch.zeros(s, dtype=DTYPE) for k, s in layout.items()}
        self.recorder = _Marks(CONSUMER_CALLS)

    def missing(self) -> list[str]:
        return self.recorder.missing

    def clear(self) -> None:
        self.recorder.marks.clear()

    def take(self, value: Any, seed: int) -> list[Mark]:
        """A medium transfer's end: the tensor (or the int) as the argument."""
        self.recorder.mark("method body")
        first = int(value.reshape(-1)[0]) if isinstance(value, torch.Tensor) else value
        if first != seed:
            raise ValueError(f"took {first}, expected {seed}")
        return self.recorder.marks

    def load(self, box: list[Any], seed: int) -> list[Mark]:
        """A weight-sync step's end: ``rd.get`` into this actor's own tensors."""
        start = time.time()
        rd.get(box[0], into=self.targets, timeout=TRANSFER_TIMEOUT_S)
        self.recorder.marks.append((STEP, start, time.time()))
        for name, tensor in self.targets.items():
            if int(tensor.reshape(-1)[-1]) != seed:
                raise ValueError(f"{name} does not hold the producer's values (seed {seed})")
        return self.recorder.marks


def timeline(ctx: Context) -> list[Row]:
    """Workload 14: each point's steps (the module's docstring), a point at a time."""
    cfg = ctx.config
    if not cfg.wants(GROUP_RAYDIRECT):
        return []
    points: list[tuple[str, Layout, bool]] = [
        (f"{format_size(n)}, one tensor", {"x": (n // ELEMENT_BYTES,)}, True)
        for n in cfg.timeline_sizes
    ]
    for tensors in cfg.timeline_tensors:
        param = f"{tensors} tensor{'s' * (tensors > 1)}, {STEP}"
        points.append((param, layout_of(tensors, cfg.state_bytes), False))
    rows: list[Row] = []
    for x, (param, layout, transfer) in enumerate(points):
        try:
            rows += _point(x, param, layout, transfer, cfg.medium_rounds, ctx)
        except Exception as exc:  # one point's failure is a finding; the others go on
            error = Row(14, TENSOR if transfer else STEP, param, x, 0, unit="us")
            error.error = describe_error(exc)
            log(f"w14 @ {param}: FAILED: {error.error}")
            rows.append(error)
    return rows


def _point(
    x: int, param: str, layout: Layout, transfer: bool, rounds: int, ctx: Context
) -> list[Row]:
    """One point's rows: a fresh pair of actors, one cold operation per system
    and ``rounds`` timed ones, the systems alternating (a transfer's baseline,
    the two calls returning an int, runs beside it)."""
    env = {"runtime_env": {"env_vars": THP_ENV}}
    producer = TimedProducer.options(**env).remote(layout)  # type: ignore[attr-defined]
    consumer = TimedConsumer.options(**env).remote(layout)  # type: ignore[attr-defined]
    try:
        missing = ray.get([producer.missing.remote(), consumer.missing.remote()],
                          timeout=SETUP_TIMEOUT_S)  # fmt: skip
        if missing[0] or missing[1]:
            log(f"w14: not in this raydirect, not marked: {', '.join(missing[0] + missing[1])}")
        systems = [INT, TENSOR] if transfer else [STEP]
        marks: dict[str, list[Steps]] = {s: [] for s in systems}
        cold: dict[str, Steps] = {}
        log(f"w14 @ {param}: 1 cold + {rounds} of {', '.join(systems)}")
        for i in range(rounds + 1):
            for system in systems:
                seed = next(ctx.seed_iter)
                steps = _operation(producer, consumer, system, seed)
                if i:
                    marks[system].append(steps)
                else:  # the cold one: pools, channels and leases made
                    cold[system] = steps
    finally:
        ray.kill(producer)
        ray.kill(consumer)
    nbytes = layout_bytes(layout)
    return [row for s in systems for row in _rows(x, param, nbytes, s, marks[s], cold[s])]


def _operation(producer: Any, consumer: Any, system: str, seed: int) -> Steps:
    """One timed operation: each marked step's (start, end) after the driver's call."""
    ray.get([producer.prepare.remote(seed), consumer.clear.remote()], timeout=SETUP_TIMEOUT_S)
    start = time.time()
    if system == STEP:
        got = consumer.load.remote([producer.state.remote()], seed)
    else:
        make = producer.number if system == INT else producer.value
        got = consumer.take.remote(make.remote(), seed)
    consumer_marks = ray.get(got, timeout=TRANSFER_TIMEOUT_S)
    steps = {CALLS: (0.0, time.time() - start)}
    producer_marks = ray.get(producer.marks.remote(), timeout=SETUP_TIMEOUT_S)
    for role, marks in (("producer", producer_marks), ("consumer", consumer_marks)):
        for name, a, b in marks:
            steps[f"{role}: {name}"] = (a - start, b - start)
    return steps


def _rows(x: int, param: str, nbytes: int, system: str, ops: list[Steps], cold: Steps) -> list[Row]:
    """A row per step of ``system`` at this point, ordered by when the step starts;
    its cold time is the step's in the first operation, where it ran then."""
    names = {name for op in ops for name in op}
    rows = []
    for name in names:
        spans = [op[name] for op in ops if name in op]
        step = f"{system}: {name}" if name != CALLS else f"{CALLS}, {system}"
        row = Row(14, step, param, x, nbytes, unit="us", times_s=[b - a for a, b in spans])
        row.cold_s = cold[name][1] - cold[name][0] if name in cold else None
        row.measured[STARTS] = statistics.median(a for a, _ in spans) * 1e3
        row.measured[ENDS] = statistics.median(b for _, b in spans) * 1e3
        rows.append(row)
    return sorted(rows, key=lambda r: (r.measured[STARTS], r.measured[ENDS]))


def timeline_table(rows: Sequence[Row]) -> str:
    """Per point, each step's median start, end and duration after the driver's call."""
    out: list[str] = []
    for param in dict.fromkeys(r.param for r in rows):
        mine = [r for r in rows if r.param == param and STARTS in r.measured]
        if not mine:
            continue
        out += [f"Timeline, {param} (ms after the driver's call, medians):", "",
                "| step | starts | ends | takes |", "|---|---:|---:|---:|"]  # fmt: skip
        for r in sorted(mine, key=lambda r: r.measured[STARTS]):
            takes = statistics.median(r.times_s) * 1e3
            out.append(
                f"| {r.system} | {r.measured[STARTS]:.2f} | {r.measured[ENDS]:.2f} | {takes:.2f} |"
            )
        out.append("")
    return "\n".join(out).rstrip()
