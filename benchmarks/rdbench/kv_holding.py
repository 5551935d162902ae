"""Workload 11's look at the engines' threads: where each may run (NixlConnector
moves its worker's main thread), and P's CPU while it holds a finished
request's blocks for a reader that has not read them yet."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import ray

from rdbench.common import SETUP_TIMEOUT_S, TRANSFER_TIMEOUT_S, Row, log

IDLE = "P cores, idle"
HOLDING = "P cores, holding blocks for D"
WINDOW_S = 2.0  # each CPU window
SETTLE_S = 2.0  # after the last request, before the idle window: vLLM's loop winds down
BUSY_SHARE = 0.05
NEAR_IDLE_CORES = 0.1  # the target: holding blocks costs P at most this over idle

Threads = list[tuple[str, str, str, float]]  # process, thread, CPUs allowed, CPU seconds


def main_threads(engines: dict[str, Any], names: dict[str, str]) -> dict[str, str]:
    """Log the CPUs each engine's threads may run on, as they ended up; return
    the CPUs its worker's main thread (the forward's) may run on, by engine."""
    log("w11 affinity (bound to: P core 0, D core 1), threads' allowed CPUs:")
    mains = {}
    for key, engine in engines.items():
        where: dict[str, list[str]] = {}
        for proc, thread, allowed, _ in ray.get(engine.threads.remote(), timeout=SETUP_TIMEOUT_S):
            name = thread.split("/")[0]
            where.setdefault(f"{proc} {allowed}", []).append(name)
            if proc == "worker" and name == "main":
                mains[key] = allowed
        cells = "; ".join(
            f"{k}: {len(v)} ({', '.join(sorted(set(v), key=lambda x: (x != 'main', x))[:4])})"
            for k, v in sorted(where.items())
        )
        huge = ray.get(engine.huge_pages.remote(), timeout=SETUP_TIMEOUT_S) >> 20
        log(f"w11   {names[key]:<12} {cells}; worker's huge pages: {huge} MiB")
    return mains


def _busy(before: Threads, after: Threads, seconds: float) -> str:
    used = {(proc, thread): cpu for proc, thread, _, cpu in before}
    busy = [
        f"{proc} {thread.split('/')[0]} [{allowed}] {(cpu - used[(proc, thread)]) / seconds:.2f}"
        for proc, thread, allowed, cpu in after
        if (proc, thread) in used and cpu - used[(proc, thread)] >= BUSY_SHARE * seconds
    ]
    return ", ".join(busy) or "none"


def _window(engine: Any) -> tuple[float, str]:
    """Cores ``engine`` used over ``WINDOW_S``, and its threads that were busy."""
    threads = ray.get(engine.threads.remote(), timeout=SETUP_TIMEOUT_S)
    before = ray.get(engine.cpu_seconds.remote(), timeout=SETUP_TIMEOUT_S)
    time.sleep(WINDOW_S)  # measuring, not synchronising
    after = ray.get(engine.cpu_seconds.remote(), timeout=SETUP_TIMEOUT_S)
    busy = _busy(threads, ray.get(engine.threads.remote(), timeout=SETUP_TIMEOUT_S), WINDOW_S)
    return (after - before) / WINDOW_S, busy


def measure_holding(p: Any, d: Any, row: Row, prompts: Sequence[list[int]]) -> None:
    """For each prompt: P idle over a window; P finishes the prompt for D and is
    measured over a window while it holds its blocks; D reads them (P frees
    them). Medians into ``row.measured``, each sample into ``row.samples``."""
    for ids in prompts:
        time.sleep(SETTLE_S)  # the last request's steps are over
        idle, idle_busy = _window(p)
        _, params = ray.get(
            p.generate.remote(ids, {"do_remote_decode": True}), timeout=TRANSFER_TIMEOUT_S
        )
        holding, busy = _window(p)
        ray.get(d.generate.remote(ids, params), timeout=TRANSFER_TIMEOUT_S)  # read: P frees
        row.samples.setdefault(IDLE, []).append(idle)
        row.samples.setdefault(HOLDING, []).append(holding)
        row.note = f"holding: {busy}; idle: {idle_busy}"
    for key in (IDLE, HOLDING):
        row.measured[key] = statistics.median(row.samples[key])
    log(
        f"w11 {row.system}: P used {row.measured[IDLE]:.2f} cores idle, "
        f"{row.measured[HOLDING]:.2f} holding blocks; {row.note}"
    )


def holding_table(rows: Sequence[Row]) -> str:
    """P's CPU, idle and holding, for each hand-off row that measured it."""
    measured = [r for r in rows if HOLDING in r.measured]
    if not measured:
        return ""
    out = [
        f"P's CPU (engine core + worker), {len(measured[0].samples[HOLDING])} window(s) of "
        f"{WINDOW_S:g} s each, medians; target: holding at most {NEAR_IDLE_CORES:g} core "
        "over idle:",
        "",
        f"| system | prompt | {IDLE} | {HOLDING} | near idle | threads (>= 5% of a core) |",
        "|---|---|---:|---:|---|---|",
    ]
    for row in measured:
        idle, holding = row.measured[IDLE], row.measured[HOLDING]
        met = round(holding - idle, 2) <= NEAR_IDLE_CORES
        out.append(
            f"| {row.system.split()[0]} | {row.param} | {idle:.2f} | {holding:.2f} | "
            f"{'yes' if met else 'no'} | {row.note} |"
        )
    return "\n".join(out)
