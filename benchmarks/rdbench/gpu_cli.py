"""benchmarks/gpu.py's command line: options, the run in blocks, the report.

The report is written after every block (each size, the weight sync), so a run
cut short (Ctrl-C, ``timeout -s INT``, the device tool's limit) still leaves the
rows it finished in ``--json`` and ``--md``; the rows it did not reach read
"not run".
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
import torch

from rdbench.common import GIB, MIB, Row, Workload, format_size, log, parse_size
from rdbench.gpu_actors import GPU_SHARE
from rdbench.gpu_rows import BASELINES, Bench
from rdbench.report import machine_facts, order_rows, render_report, report_json

MAX_BYTES = 4 * GIB  # int32 pattern: i + seed stays below 2**31 (seeds < 2**30)
DESCRIPTION = "raydirect on one CUDA GPU against Ray's RDT and Ray's object store."


def _no_run(_ctx: Any) -> list[Row]:
    return []  # rows are made by run(); Workload only describes the tables


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


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmarks/gpu.py", description=DESCRIPTION)
    add = parser.add_argument
    add("--sizes", default="1MiB,16MiB,256MiB,1GiB,4GiB", help="workloads 1-2 [%(default)s]")
    add("--repeats", type=int, default=5, help="timed transfers after the cold one [%(default)s]")
    add("--state-size", default="256MiB", help="workload 3: the state dict's size [%(default)s]")
    add("--sync-steps", type=int, default=10, help="workload 3: timed syncs [%(default)s]")
    add("--json", metavar="PATH", help="every raw timing ('-': stdout, tables to stderr)")
    add("--md", metavar="PATH", help="the tables, also written after every block")
    add("--no-nixl", action="store_true", help="leave out the NIXL rows")
    add("--nixl-only", action="store_true", help="only the NIXL rows")
    add("--skip-if-no-gpu", action="store_true", help="exit 0 instead of 2 without a GPU")
    args = parser.parse_args(argv)
    try:
        args.size_list = [parse_size(s, MAX_BYTES) for s in args.sizes.split(",") if s.strip()]
        args.state_bytes = parse_size(args.state_size, MAX_BYTES)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.state_bytes < MIB:
        parser.error("--state-size must be at least 1MiB")
    if args.repeats < 1 or args.sync_steps < 1:
        parser.error("--repeats and --sync-steps must be at least 1")
    return args


def blocks(args: argparse.Namespace) -> list[tuple[str, Callable[[Bench], list[Row]]]]:
    """The run's blocks in order, each named; NIXL last (its progress thread keeps
    polling for the life of its process, benchmarks/README.md)."""
    out: list[tuple[str, Callable[[Bench], list[Row]]]] = []
    for n in [] if args.nixl_only else args.size_list:
        out.append((format_size(n), lambda b, n=n: b.sizes(n)))
    if not args.nixl_only:
        state = format_size(args.state_bytes)
        out.append((f"weight sync, {state}", lambda b: b.weight_sync(args.state_bytes)))
    if not args.no_nixl:
        for n in args.size_list:
            out.append((f"NIXL, {format_size(n)}", lambda b, n=n: b.nixl_sizes(n)))
    return out


def not_run(name: str, why: str) -> Row:
    return Row(1, f"not run: {name}", "-", 0, 0, skipped=why)


class Report:
    """The report so far, rewritten in full after every block."""

    def __init__(self, args: argparse.Namespace, facts: dict[str, Any], header: str) -> None:
        self.args, self.facts, self.header = args, facts, header
        self.started = time.perf_counter()
        self.rows: list[Row] = []

    def settings(self) -> dict[str, Any]:
        a = self.args
        return {
            "sizes": a.size_list,
            "repeats": a.repeats,
            "state_bytes": a.state_bytes,
            "sync_steps": a.sync_steps,
            "gpu_share": GPU_SHARE,
        }

    def text(self) -> str:
        elapsed = time.perf_counter() - self.started
        return render_report(list(WORKLOADS.values()), order_rows(self.rows), self.header, elapsed)

    def write(self) -> None:
        """The files named by --md and --json (not '-'), as they stand now."""
        if self.args.md:
            with open(self.args.md, "w") as f:
                f.write(self.text() + "\n")
        if self.args.json and self.args.json != "-":
            with open(self.args.json, "w") as f:
                json.dump(self.json(), f, indent=2)

    def json(self) -> dict[str, Any]:
        elapsed = time.perf_counter() - self.started
        workloads = list(WORKLOADS.values())
        return report_json(workloads, order_rows(self.rows), self.facts, self.settings(), elapsed)


def run(args: argparse.Namespace, report: Report) -> None:
    """Every block, the report written after each; Ctrl-C (SIGINT) ends the run
    with the blocks not reached marked."""
    todo = blocks(args)
    bench = None
    try:
        bench = Bench(args.repeats, args.sync_steps)
        while todo:
            name, block = todo[0]
            log(f"== {name}")
            report.rows += block(bench)
            todo.pop(0)
            report.write()
    except KeyboardInterrupt:
        log(f"interrupted: {len(todo)} block(s) not run")
        report.rows += [not_run(name, "interrupted (time limit)") for name, _ in todo]
    finally:
        if bench is not None:
            bench.close()


def gpu_facts() -> tuple[dict[str, Any], str]:
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
    return facts, header


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "benchmarks/gpu.py needs a CUDA GPU; this machine has none "
            "(torch.cuda.is_available() is False). Run it where one is: docs/gpu.md.",
            file=sys.stderr,
        )
        return 0 if args.skip_if_no_gpu else 2
    facts, header = gpu_facts()
    log(header.removeprefix("# "))
    report = Report(args, facts, header)
    ray.init(
        num_cpus=8,
        num_gpus=torch.cuda.device_count(),
        include_dashboard=False,
        logging_level=logging.WARNING,
    )
    try:
        run(args, report)
    finally:
        ray.shutdown()
        report.write()
    return finish(args, report)


def finish(args: argparse.Namespace, report: Report) -> int:
    """Print the tables (and the JSON for '-'); 1 if a raydirect row failed."""
    print(report.text(), file=sys.stderr if args.json == "-" else sys.stdout, flush=True)
    if args.json == "-":
        json.dump(report.json(), sys.stdout, indent=2)
        print()
    elif args.json:
        log(f"raw timings written to {args.json}")
    failed = [r for r in report.rows if r.error and not r.system.startswith("ray RDT")]
    for row in failed:
        log(f"FAILED: w{row.workload} {row.system} @ {row.param}: {row.error}")
    return 1 if failed else 0
