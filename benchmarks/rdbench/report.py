"""Rendering: one markdown table per workload, the JSON report, the PNG plot."""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Sequence
from typing import Any, NamedTuple

import ray
import torch

import raydirect as rd
from rdbench.common import RDT_NIXL, THP_ENV, Row, Workload, format_size

PLOT_INSTALL = "pip install 'raydirect[bench]'  (in a checkout: ./dev pip install -e '.[bench]')"


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


def order_rows(rows: Sequence[Row]) -> list[Row]:
    """By workload, then point (size, consumers), then system in the order the
    systems first ran (raydirect, Ray, RDT, floors)."""
    first: dict[tuple[int, str], int] = {}
    for i, row in enumerate(rows):
        first.setdefault((row.workload, row.system), i)
    return sorted(rows, key=lambda r: (r.workload, r.x, first[(r.workload, r.system)]))


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "us":
        return f"{value:.0f}"
    return f"{value:.2f}" if value >= 0.1 else f"{value:.2g}"  # 4 KiB moves at ~0.0005 GB/s


def _ratio(row: Row, baseline: Row | None) -> str:
    mine = row.median()
    base = baseline.median() if baseline else None
    if mine is None or not base:
        return "-"
    return f"{mine / base:.2f}x"


def _short(reason: str, limit: int = 240) -> str:
    """A reason cut to its first sentences within ``limit`` characters (the JSON
    keeps it whole)."""
    if len(reason) <= limit:
        return reason
    cut = reason.rfind(". ", 0, limit)
    return reason[: cut + 1] if cut > limit // 2 else reason[:limit] + "..."


def render_table(workload: Workload, rows: Sequence[Row]) -> str:
    """A markdown table: text columns left-aligned, numbers right-aligned; a row
    that failed or cannot run here reads ``n/a: <reason>`` across the numbers."""
    unit = workload.unit
    shown = "µs" if unit == "us" else unit
    per = " per round trip" if unit == "us" else ""
    headers = [
        workload.param_header,
        "system",
        f"median {shown}{per}",
        f"min-max {shown}",
        f"cold {shown}",
    ]
    if unit != "us":
        headers.append("median ms")
    word = "time vs" if unit == "us" else "vs"
    # Only baselines this run measured (a nixl-only run compares with RDT over NIXL).
    present = {r.system for r in rows if r.error is None and r.skipped is None}
    baselines = [b for b in (*workload.baselines, RDT_NIXL) if b in present]
    headers += [f"{word} {b}" for b in baselines]
    by_key = {(r.system, r.param): r for r in rows}
    lines: list[list[str]] = []
    for row in rows:
        if row.error is not None or row.skipped is not None:
            if row.error is not None:
                why = f"n/a: {_short(row.error)}"
            else:
                why = f"n/a (skipped): {_short(row.skipped or '')}"
            lines.append([row.param, row.system, why])
            continue
        vals = row.values()
        cells = [
            row.param,
            row.system,
            _fmt(row.median(), unit),
            f"{_fmt(min(vals), unit)}-{_fmt(max(vals), unit)}" if vals else "-",
            _fmt(row.cold_value(), unit),
        ]
        if unit != "us":
            times = row.times_s
            ms = statistics.median(times) * 1e3 if times else None
            cells.append("-" if ms is None else f"{ms:.1f}" if ms >= 1 else f"{ms:.2g}")
        cells += [_ratio(row, by_key.get((b, row.param))) for b in baselines]
        lines.append(cells)
    # An n/a message sets no column width: its row is left unaligned.
    full = [line for line in lines if len(line) == len(headers)]
    widths = [max([len(h)] + [len(line[i]) for line in full]) for i, h in enumerate(headers)]

    def fmt(cells: list[str]) -> str:
        if len(cells) < len(headers):
            padded = [cells[0].ljust(widths[0]), cells[1].ljust(widths[1]), *cells[2:]]
        else:
            padded = [
                c.ljust(w) if i < 2 else c.rjust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            ]
        return "| " + " | ".join(padded) + " |"

    rule = (
        "|"
        + "|".join("-" * (w + 2) if i < 2 else "-" * (w + 1) + ":" for i, w in enumerate(widths))
        + "|"
    )
    return "\n".join([fmt(headers), rule, *(fmt(line) for line in lines)])


def render_report(
    workloads: Sequence[Workload], rows: Sequence[Row], header: str, elapsed_s: float
) -> str:
    parts = [header]
    for workload in workloads:
        mine = [r for r in rows if r.workload == workload.number]
        if not mine:
            continue
        parts += ["", f"## {workload.number}. {workload.title}", "", render_table(workload, mine)]
        summary = workload.summary(mine) if workload.summary is not None else ""
        if summary:
            parts += ["", summary]
    parts += [
        "",
        f"# {elapsed_s:.0f} s in all; GB/s = bytes / seconds / 1e9; median and min-max over "
        "the repeats after the first (cold) operation of each system and point; "
        "ratios divide medians at the same point (for µs: time / baseline time).",
    ]
    return "\n".join(parts)


class TargetLine(NamedTuple):
    """One target at one point: ``measured`` must be at most (or at least) ``bound``;
    ``floor`` is the same ratio for the in-process copy, where one applies."""

    what: str
    bound: float
    at_most: bool
    point: str
    measured: float | None
    floor: float | None


TIME_RATIOS = "Targets (ratios of median step times in this run; the floor: one in-process copy):"


def render_targets(lines: Sequence[TargetLine], title: str = TIME_RATIOS) -> str:
    """Markdown under a workload's table: target, point, measured, the floor's,
    met (judged as printed); lines whose rows did not run are left out."""
    out = [
        title,
        "",
        "| target | point | measured | the floor's own | met |",
        "|---|---|---:|---:|---|",
    ]
    for line in lines:
        if line.measured is None:
            continue
        shown = round(line.measured, 2)
        met = shown <= line.bound if line.at_most else shown >= line.bound
        target = f"{line.what}, {'at most' if line.at_most else 'at least'} {line.bound:g}x"
        floor = "-" if line.floor is None else f"{line.floor:.2f}x"
        out.append(
            f"| {target} | {line.point} | {shown:.2f}x | {floor} | {'yes' if met else 'no'} |"
        )
    return "\n".join(out) if len(out) > 4 else ""


def report_json(
    workloads: Sequence[Workload],
    rows: Sequence[Row],
    facts: dict[str, Any],
    config: dict[str, Any],
    elapsed_s: float,
) -> dict[str, Any]:
    return {
        "machine": facts,
        "config": config,
        "elapsed_s": elapsed_s,
        "workloads": {
            str(w.number): {
                "title": w.title,
                "param": w.param_header,
                "unit": w.unit,
                "baselines": list(w.baselines),
            }
            for w in workloads
        },
        "rows": [r.as_json() for r in rows],
    }


def plot_available() -> str | None:
    """None if matplotlib is importable, else what to run to install it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"--plot needs matplotlib, which is not installed: {PLOT_INSTALL}"
    return None


def write_plot(path: str, rows: Sequence[Row], header: str) -> bool:
    """Throughput against size (log x), one line per system: workload 1, and
    workload 2's GB/s against consumers beside it when it ran. False if there is
    nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (1, "actor -> actor, one tensor", "tensor size", True),
        (2, "weight sync (bytes delivered)", "consumers", False),
    ]
    panels = [p for p in panels if any(r.workload == p[0] and r.median() for r in rows)]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 5.5), squeeze=False)
    for ax, (number, title, xlabel, sizes) in zip(axes[0], panels, strict=True):
        mine = [r for r in rows if r.workload == number and r.median() is not None]
        for system in dict.fromkeys(r.system for r in mine):
            points = sorted((r.x, r.median(), r) for r in mine if r.system == system)
            xs = [p[0] for p in points]
            style = ":" if system.startswith("floor") else "-"
            ax.plot(xs, [p[1] for p in points], style, marker="o", label=system)
        ax.set_xscale("log", base=2)
        if sizes:  # 4 KiB and 1 GiB rates differ by orders of magnitude
            ax.set_yscale("log")
        ticks = sorted({r.x for r in mine})
        ax.set_xticks(ticks)
        ax.set_xticklabels([format_size(int(t)) if sizes else f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel(xlabel)
        ax.set_ylabel("median GB/s")
        ax.set_title(f"{number}. {title}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(header.removeprefix("# "), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
