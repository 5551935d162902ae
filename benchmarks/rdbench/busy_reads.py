"""Workload 17: reads in a process where another thread runs Python.

The question: what does a read cost a process that is not idle? A trainer's
data loader, a server's event loop or an inference engine's scheduler runs
Python in a thread of its own beside the reads. Every call in a read that lets
the GIL go then waits up to the switch interval (5 ms) to have it back, so a
read that lets it go once per tensor costs milliseconds per tensor there,
however fast it is alone.

A reader actor reads the same objects with and without a second thread that
counts in Python (``BusyReader.busy``), each read timed inside the reader: one
1 MiB tensor, 64 float32 tensors of 16 KiB, and 64 bfloat16 tensors of one
shape (a dtype numpy lacks). Two systems: ``rd.get`` of a ``@rd.method``'s ref
and ``ray.get`` of a plain method's (the object store). Both include the
``ray.get`` of the ref, which lets the GIL go while Ray fetches. Every value is
checked, untimed. Systems, objects and both thread settings run in interleaved
rounds of ``_BATCH`` reads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import ray
import torch

import raydirect as rd
from rdbench.common import (
    ACTOR_NUM_CPUS,
    GROUP_RAY,
    GROUP_RAYDIRECT,
    MIB,
    OBJECT_STORE,
    SETUP_TIMEOUT_S,
    TRANSFER_TIMEOUT_S,
    Row,
    describe_error,
    log,
)
from rdbench.fleet import Context

RD_GET = "raydirect rd.get"
ALONE, BUSY = "alone", "beside a busy thread"
# name -> (tensors, shape, dtype): each tensor ``i`` holds ``i % 7`` everywhere.
OBJECTS = {
    "1 tensor, 1 MiB": (1, (MIB // 4,), torch.float32),
    "64 float32 tensors, 1 MiB": (64, (4096,), torch.float32),
    "64 bfloat16 tensors, 1 MiB": (64, (64, 128), torch.bfloat16),
}
SYSTEMS = ((RD_GET, GROUP_RAYDIRECT, "direct"), (OBJECT_STORE, GROUP_RAY, "plain"))
_BATCH = 5  # reads per system, object and thread setting in a round


def _value(kind: str) -> Any:
    count, shape, dtype = OBJECTS[kind]
    tensors = [torch.full(shape, i % 7, dtype=dtype) for i in range(count)]
    return tensors[0] if count == 1 else {f"layer{i}": t for i, t in enumerate(tensors)}


def _check(kind: str, value: Any) -> None:
    count, shape, dtype = OBJECTS[kind]
    tensors = [value] if count == 1 else [value[f"layer{i}"] for i in range(count)]
    for i, t in enumerate(tensors):
        if t.dtype != dtype or tuple(t.shape) != shape or float(t.reshape(-1)[-1]) != i % 7:
            raise ValueError(f"{kind}: tensor {i} arrived wrong ({t.dtype}, {tuple(t.shape)})")


@ray.remote(num_cpus=ACTOR_NUM_CPUS)
class Source:
    """The objects, returned directly (``@rd.method``) or through Ray's object store."""

    def __init__(self) -> None:
        self.values = {kind: _value(kind) for kind in OBJECTS}

    @rd.method
    def direct(self, kind: str) -> Any:
        return self.values[kind]

    def plain(self, kind: str) -> Any:
        return self.values[kind]


@ray.remote(num_cpus=ACTOR_NUM_CPUS)
class BusyReader:
    """Reads refs, each read timed here; with a thread counting in Python, or not."""

    def __init__(self) -> None:
        self.count = 0
        self.stop: threading.Event | None = None

    def busy(self, on: bool) -> int:
        """Start or stop the counting thread; how far it has counted."""
        if on and self.stop is None:
            stop = self.stop = threading.Event()

            def count() -> None:
                while not stop.is_set():
                    self.count += 1

            threading.Thread(target=count, name="busy-python", daemon=True).start()
        elif not on and self.stop is not None:
            self.stop.set()
            self.stop = None
        return self.count

    def timed(self, how: str, kind: str, refs: list[Any]) -> list[float]:
        get = rd.get if how == "direct" else ray.get
        seconds, values = [], []
        for ref in refs:
            start = time.perf_counter()
            value = get(ref, timeout=TRANSFER_TIMEOUT_S)
            seconds.append(time.perf_counter() - start)
            values.append(value)
            del value
        for value in values:
            _check(kind, value)
        return seconds


def busy_reads(ctx: Context) -> list[Row]:
    """Workload 17 (the module's docstring): ``--rounds`` interleaved rounds."""
    cfg = ctx.config
    chosen = [s for s in SYSTEMS if cfg.wants(s[1])]
    rows = {
        (system, kind, thread): Row(17, system, f"{kind}, {thread}", MIB, MIB, unit="us")
        for system, _, _ in chosen
        for kind in OBJECTS
        for thread in (ALONE, BUSY)
    }
    if not rows:
        return []
    source, reader = Source.remote(), BusyReader.remote()
    try:
        ray.get(
            [source.__ray_ready__.remote(), reader.__ray_ready__.remote()], timeout=SETUP_TIMEOUT_S
        )
        live = set(rows)
        for round_ in range(cfg.medium_rounds + 1):
            for thread in (ALONE, BUSY):
                ray.get(reader.busy.remote(thread == BUSY), timeout=SETUP_TIMEOUT_S)
                for key in [k for k in rows if k[2] == thread and k in live]:
                    _batch(rows[key], source, reader, key, first=round_ == 0, live=live)
        counted = ray.get(reader.busy.remote(False), timeout=SETUP_TIMEOUT_S)
        log(f"w17: the busy thread counted to {counted:,}")
    finally:
        ray.kill(reader)
        ray.kill(source)
    return list(rows.values())


def _batch(row: Row, source: Any, reader: Any, key: tuple[str, str, str], first: bool,
           live: set[tuple[str, str, str]]) -> None:  # fmt: skip
    """``_BATCH`` reads of one system, object and thread setting: the first of the
    run is the row's cold read."""
    system, kind, _ = key
    how = next(h for s, _, h in SYSTEMS if s == system)
    try:
        refs = [getattr(source, how).remote(kind) for _ in range(_BATCH)]
        ray.wait(refs, num_returns=len(refs), timeout=TRANSFER_TIMEOUT_S)
        seconds = ray.get(reader.timed.remote(how, kind, refs), timeout=TRANSFER_TIMEOUT_S)
    except Exception as exc:  # the row says why; the others go on
        row.error = describe_error(exc)
        log(f"w17 {row.system} @ {row.param}: FAILED: {row.error}")
        live.discard(key)
        return
    if first:
        row.cold_s, seconds = seconds[0], seconds[1:]
    row.times_s += seconds


def busy_summary(rows: Sequence[Row]) -> str:
    """Each system's median beside the busy thread over its median alone."""
    median = {(r.system, r.param): m for r in rows if (m := r.median()) is not None}
    lines = [
        "| system | object | alone, µs | beside a busy thread, µs | ratio |",
        "|---|---|---:|---:|---:|",
    ]
    for system, _, _ in SYSTEMS:
        for kind in OBJECTS:
            alone = median.get((system, f"{kind}, {ALONE}"))
            busy = median.get((system, f"{kind}, {BUSY}"))
            if alone and busy:
                lines.append(
                    f"| {system} | {kind} | {alone:.0f} | {busy:.0f} | {busy / alone:.2f}x |"
                )
    return "\n".join(lines) if len(lines) > 2 else ""
