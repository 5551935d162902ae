"""Workload 9's stall: how long a request being served waits for its next token
because of an update.

The engine keeps serving while the raydirect backend receives (phase one runs
beside the engine's steps); only ``finish_weight_update``'s load runs between
two steps and stops it. To see what a client sees, one greedy request streams
(``Engine.stream`` in ``rdbench.vllm_actors``: vLLM's ``AsyncLLM`` in an async
Ray actor, so the update's calls reach the engine while it serves) and every
token's arrival is recorded. Once ``BEFORE`` tokens have arrived the driver runs
one update; ``AFTER`` tokens after it returns, the request ends. The **stall** is
the longest gap between two consecutive tokens that overlaps the update (from
the driver's call to its return); the **gap with no update** is the gap between
the tokens before it. Every process here reads one clock (``time.monotonic()``,
the machine's ``CLOCK_MONOTONIC``), so the engine's arrivals and the driver's
window compare directly.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import ray

from rdbench.common import SETUP_TIMEOUT_S, TRANSFER_TIMEOUT_S, Row

BEFORE = 12  # tokens streamed before the update starts: the gaps with no update
AFTER = 3  # tokens after it returns: the gap it ends in has closed

# Row.samples (seconds, one per streamed update) and Row.measured (their medians, ms)
STALL = "stall"
UPDATE = "update while streaming"
GAP = "gap between tokens, no update"  # every gap before the updates, pooled
LONGEST_GAP = "longest gap, no update"


class Update(NamedTuple):
    """One update: its time as its row counts it, and its window in the driver
    (``time.monotonic()``: from the first call of the update to its return)."""

    seconds: float
    start: float
    end: float


def window(call: Callable[[], Any]) -> tuple[Any, float, float]:
    """``call()``'s result, and when it started and returned."""
    start = time.monotonic()
    got = call()
    return got, start, time.monotonic()


@dataclass
class Stall:
    update_s: float
    stall_s: float  # the longest gap between two tokens that overlaps the update
    gaps_s: list[float]  # the gaps between the tokens before it


def stall_of(times: Sequence[float], update: Update) -> Stall:
    """The stall of ``update`` in a stream whose tokens arrived at ``times``."""
    if len([t for t in times if t <= update.start]) < 2:
        raise RuntimeError(f"the request streamed {len(times)} tokens, too few before the update")
    if times[-1] <= update.end:
        raise RuntimeError(
            f"the request ended {update.end - times[-1]:.3f} s before the update returned: "
            "its stall is unknown (raise STREAM_TOKENS in rdbench/vllm_shared.py)"
        )
    pairs = list(zip(times[:-1], times[1:], strict=True))
    over = [b - a for a, b in pairs if b > update.start and a < update.end]
    before = [b - a for a, b in pairs if b <= update.start]
    return Stall(update.seconds, max(over), before)


def _streamed(engine: Any, during: Callable[[], Any]) -> tuple[list[float], Any]:
    """``during()`` once ``engine`` has streamed ``BEFORE`` tokens of a request;
    the arrival times of all its tokens (the last ``AFTER`` after ``during``
    returned), and what ``during`` returned."""
    sid = f"rdbench-stall-{uuid.uuid4().hex[:12]}"
    stream = engine.stream.remote(sid)
    try:
        got = ray.get(engine.wait_tokens.remote(sid, BEFORE), timeout=SETUP_TIMEOUT_S)
        if got < BEFORE:  # the request ended: its call says why
            ray.get(stream, timeout=SETUP_TIMEOUT_S)
            raise RuntimeError(f"the request ended after {got} tokens")
        done = during()
    finally:  # also after a failure: the request must not stream on into the next update
        ray.get(engine.end_stream.remote(sid, AFTER), timeout=SETUP_TIMEOUT_S)
    return ray.get(stream, timeout=TRANSFER_TIMEOUT_S), done


def warm_up(engine: Any) -> None:
    """An engine's first request decodes slowly (its kernels are set up on first
    use: one gap of 1.5 s at tensor parallel 2 here), so one streams, untimed,
    before the first stall is measured."""
    _streamed(engine, lambda: None)


def measure(engine: Any, update: Callable[[], Update]) -> Stall:
    """One ``update()`` while ``engine`` streams a request, and its stall."""
    times, done = _streamed(engine, update)
    return stall_of(times, done)


def record(row: Row, stall: Stall) -> None:
    """Adds one streamed update to ``row``: its samples, and their medians in ms."""
    samples = row.samples
    samples.setdefault(STALL, []).append(stall.stall_s)
    samples.setdefault(UPDATE, []).append(stall.update_s)
    samples.setdefault(GAP, []).extend(stall.gaps_s)
    for key in (STALL, UPDATE, GAP):
        row.measured[f"{key} ms"] = statistics.median(samples[key]) * 1e3
    row.measured[f"{LONGEST_GAP} ms"] = max(samples[GAP]) * 1e3


def median_stall(row: Row | None) -> float | None:
    if row is None or row.error is not None or not row.samples.get(STALL):
        return None
    return statistics.median(row.samples[STALL])


def render_stalls(rows: Sequence[Row], floor: str) -> str:
    """The stall table: each streamed row's medians beside the floor's at its point."""
    streamed = [r for r in rows if median_stall(r) is not None]
    if not streamed:
        return ""
    by_key = {(r.system, r.param): r for r in streamed}
    out = [
        "Stall while a request streams: the longest gap between two of its tokens that "
        "overlaps the update (median over the streamed updates, ms), the update's own time "
        "then, and the gap between tokens with no update (the engine's step):",
        "",
        "| point | system | updates | stall ms | update ms | stall / floor (b)'s stall "
        "| stall / floor (b)'s update | gap, no update: median ms | longest ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in streamed:
        base = by_key.get((floor, row.param))
        stall = median_stall(row) or 0.0
        ratios = ["-", "-"]
        if base is not None:
            ratios = [
                f"{stall / (median_stall(base) or 1.0):.2f}x",
                f"{stall / statistics.median(base.samples[UPDATE]):.2f}x",
            ]
        m = row.measured
        out.append(
            f"| {row.param} | {row.system} | {len(row.samples[STALL])} | {stall * 1e3:.1f} "
            f"| {m[f'{UPDATE} ms']:.1f} | {' | '.join(ratios)} | {m[f'{GAP} ms']:.1f} "
            f"| {m[f'{LONGEST_GAP} ms']:.1f} |"
        )
    return "\n".join(out)
