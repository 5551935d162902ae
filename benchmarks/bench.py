"""raydirect against Ray's object store and Ray's RDT, seventeen workloads, one Ray session.

1. actor -> actor, one tensor, 4 KiB ... 1 GiB
2. weight sync: a 256 MiB state dict of 200 tensors to 1, 2 and 4 consumers
3. small objects: 1,000 round trips of a 4 KiB tensor (µs per round trip)
4. 8 refs from 4 producers read with one call (rd.get vs ray.get)
5. the driver reads one 512 MiB tensor
6. weight sync through the weight API: 256 MiB as 1, 200 and 5,000 tensors
7. weight sync from a sharded trainer: 256 MiB, rows on N ranks to columns on N workers
8. medium transfers: 4 KiB to 16 MiB against the two calls they ride on (µs per transfer)
9. one whole weight update of a vLLM engine (~320 MiB Llama) through the raydirect backend
   (needs vLLM: bash scripts/setup-vllm-venv.sh && .venv-vllm/bin/python benchmarks/bench.py
   --workloads 9; elsewhere its rows are skipped)
10. ranged reads of a long-lived region: 1 MiB and 16 MiB of 8 KiB KV blocks (µs per read),
   against one in-process copy of the same runs and a NIXL READ of them (--groups ...,nixl)
11. the KV hand-off between two vLLM engines through RaydirectConnector, prompts of 128,
   512 and 2,048 tokens, beside NixlConnector (--groups ...,nixl), ExampleConnector and D
   prefilling itself, and P's CPU while it holds blocks (needs vLLM, as 9: --workloads 11)
12. planning a reshard of a 1T-parameter MoE, 256 trainer ranks to 128 workers (no Ray)
13. what a lifetime costs consecutive 1 MiB transfers, in time and CPU (lease, reads=1, rd.put)
14. where one transfer's time goes, step by step in both processes (a profiling aid)
15. one tensor across two real Ray nodes in network namespaces, iperf3 beside (root; only
   when named in --workloads)
16. one tensor from one node to four consumers on two others, with the copies sent (root;
   only when named)

Every value moved is checked. Tables (markdown, with ratios) go to stdout,
progress lines to stderr. See benchmarks/README.md for what each row means.

    ./dev raydirect bench [--workloads 1,2,3,4,5,6,7,8,9,10,11,12,13,14,17] [--quick] [--groups ...]
                          [--json out.json] [--plot out.png]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # rdbench, also for Ray's workers

import ray  # noqa: E402
from rdbench.catalog import WORKLOADS  # noqa: E402
from rdbench.common import (  # noqa: E402
    DEFAULT_GROUPS,
    GROUPS,
    LARGE_REPEATS_FROM,
    MIB,
    RAY_NUM_CPUS,
    THP_ENV,
    THP_ENV_VAR,
    Row,
    format_size,
    log,
    parse_size,
)
from rdbench.fleet import Config, Context  # noqa: E402
from rdbench.report import (  # noqa: E402
    machine_facts,
    order_rows,
    plot_available,
    render_report,
    report_json,
    write_plot,
)

from raydirect.transports.shm import sweep_after_shutdown  # noqa: E402

# Each workload option: (name, type, what it sets, full run's default, --quick's).
# Sizes ("size", "sizes") take 4KiB, 64MiB, 4096; counts ("count", "counts") numbers.
OPTIONS = (
    ("sizes", "sizes", "workload 1: sizes", "4KiB,1MiB,64MiB,512MiB,1GiB", "4KiB,1MiB,64MiB"),
    ("state_size", "size", "workloads 2, 6, 7, 14: state dict size; 16: the tensor's",
     "256MiB", "32MiB"),
    ("consumers", "counts", "workloads 2, 6: consumer counts; 7: N -> N for each from 2",
     "1,2,4", "1,2,4"),
    ("sync_steps", "count", "workloads 2, 6, 7: timed steps after the cold one", "10", "2"),
    ("round_trips", "count", "workload 3: round trips", "1000", "200"),
    ("part_size", "size", "workload 4: bytes per ref", "32MiB", "4MiB"),
    ("driver_size", "size", "workload 5: the driver's tensor", "512MiB", "64MiB"),
    ("medium_sizes", "sizes", "workload 8: sizes", "4KiB,64KiB,256KiB,1MiB,4MiB,16MiB",
     "4KiB,1MiB"),
    ("rounds", "count", "workload 8: timed transfers per system, in blocks; 10, 14: rounds",
     "40", "3"),
    ("kv_rounds", "count", "workload 11: interleaved rounds", "10", "2"),
    # 128 in --quick too: 4 s, and the spread is judged over every worker
    ("plan_workers", "count", "workload 12: workers whose plans are summed", "128", "128"),
    ("lease_blocks", "count", "workload 13: blocks of 25 transfers per system", "8", "1"),
    ("timeline_sizes", "sizes", "workload 14: one-tensor transfers", "1MiB,16MiB", "1MiB"),
    ("timeline_tensors", "counts", "workload 14: state dicts of 1, 200 or 5000 tensors",
     "1,200,5000", "200"),
    ("node_sizes", "sizes", "workload 15: sizes across two nodes", "64MiB,512MiB,1GiB", "64MiB"),
)  # fmt: skip
# Workloads 15 and 16 start a cluster in network namespaces (root), which a test
# run on the same machine may be using: they run only when named.
DEFAULT_WORKLOADS = "1,2,3,4,5,6,7,8,9,10,11,12,13,14,17"
REPEATS, QUICK_REPEATS = 5, 2
LARGE_REPEATS = 3  # full run: for operations moving LARGE_REPEATS_FROM bytes or more
TIMELINE_TENSORS = {1, 200, 5000}  # workload 6's layouts


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raydirect bench",
        description=(__doc__ or "").split("\n\n")[0],
        epilog="Defaults in brackets are (full run / --quick).",
    )
    parser.add_argument(
        "--workloads",
        default=DEFAULT_WORKLOADS,
        help=f"which workloads to run, e.g. 1,3 [{DEFAULT_WORKLOADS}; 15 and 16 need root]",
    )
    parser.add_argument(
        "--groups",
        default=",".join(DEFAULT_GROUPS),
        help=f"which families of rows to run, of {','.join(GROUPS)} "
        f"[default: {','.join(DEFAULT_GROUPS)}; nixl rows run in a run of their own]",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument(
        "--repeats",
        type=int,
        help=f"timed operations after the cold one [{REPEATS} / {QUICK_REPEATS}]; the full run "
        f"uses {LARGE_REPEATS} where an operation moves {format_size(LARGE_REPEATS_FROM)} or more",
    )
    for name, _, what, full, quick in OPTIONS:
        parser.add_argument(f"--{name.replace('_', '-')}", help=f"{what} [{full} / {quick}]")
    parser.add_argument(
        "--json", metavar="PATH", help="write every raw timing here ('-': stdout, tables to stderr)"
    )
    parser.add_argument(
        "--plot", metavar="PNG", help="write GB/s against size (workloads 1 and 2) here"
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options, each workload option turned into its values (``OPTIONS``):
    sizes in bytes, counts as ints; a bad value stops with a message."""
    parser = _parser()
    args = parser.parse_args(argv)
    for name, kind, _, full, quick in OPTIONS:
        given = getattr(args, name)
        text = given if given is not None else (quick if args.quick else full)
        flag = f"--{name.replace('_', '-')}"
        try:
            values = [_value(v, kind, flag) for v in text.split(",") if v.strip()]
        except argparse.ArgumentTypeError as exc:
            parser.error(str(exc))
        if not values:
            parser.error(f"{flag}: expected a value, got {text!r}")
        setattr(args, name, values if kind.endswith("s") else values[0])
    args.workload_list = _checked(parser, args.workloads, "--workloads", set(WORKLOADS))
    args.group_list = _checked(parser, args.groups, "--groups", set(GROUPS), str)
    if args.state_size < MIB:
        parser.error("--state-size must be at least 1MiB")
    if set(args.timeline_tensors) - TIMELINE_TENSORS:
        parser.error(f"--timeline-tensors takes 1, 200 or 5000, got {args.timeline_tensors}")
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.plot:
        missing = plot_available()
        if missing:
            parser.error(missing)
    return args


def _value(text: str, kind: str, flag: str) -> int:
    """One size (``kind`` "size"/"sizes") or positive count, or why not."""
    if kind.startswith("size"):
        return parse_size(text)
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{flag}: expected numbers, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{flag}: expected positive numbers, got {text!r}")
    return value


def _checked(
    parser: argparse.ArgumentParser, text: str, flag: str, known: set[Any], kind: Any = int
) -> list[Any]:
    """Comma-separated choices, each one of ``known``."""
    try:
        chosen = [kind(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        parser.error(f"{flag}: expected comma-separated numbers, got {text!r}")
    unknown = set(chosen) - known
    if unknown or not chosen:
        parser.error(f"{flag}: unknown {sorted(unknown)}; choose from {sorted(known)}")
    return chosen


def _config(args: argparse.Namespace) -> Config:
    def repeats(nbytes: int) -> int:
        if args.repeats is not None:
            return int(args.repeats)
        if args.quick:
            return QUICK_REPEATS
        return LARGE_REPEATS if nbytes >= LARGE_REPEATS_FROM else REPEATS

    return Config(
        workloads=sorted(args.workload_list),
        groups=args.group_list,
        sizes=args.sizes,
        repeats=repeats,
        state_bytes=args.state_size,
        consumers=args.consumers,
        sync_steps=args.sync_steps,
        round_trips=args.round_trips,
        part_bytes=args.part_size,
        driver_bytes=args.driver_size,
        medium_sizes=args.medium_sizes,
        medium_rounds=args.rounds,
        quick=args.quick,
        kv_rounds=args.kv_rounds,
        plan_workers=args.plan_workers,
        lease_blocks=args.lease_blocks,
        timeline_sizes=args.timeline_sizes,
        timeline_tensors=args.timeline_tensors,
        node_sizes=args.node_sizes,
    )


def _run(config: Config) -> list[Row]:
    """Every chosen workload in one embedded Ray session, its actors shared."""
    ray.init(
        num_cpus=RAY_NUM_CPUS,
        include_dashboard=False,
        runtime_env={"env_vars": THP_ENV},
        logging_level=logging.WARNING,
    )
    rows: list[Row] = []
    ctx = Context(config)
    try:
        ctx.start()
        for number in config.workloads:
            workload = WORKLOADS[number]
            log(f"== workload {number}: {workload.title}")
            rows += workload.run(ctx)
        ctx.close()
    finally:
        ray.shutdown()
        sweep_after_shutdown()
    return order_rows(rows)


def _write_json(path: str, report: dict[str, Any]) -> None:
    if path == "-":
        json.dump(report, sys.stdout, indent=2)
        print()
        return
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    log(f"raw timings written to {path}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    config = _config(args)
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
    log(f"workloads {config.workloads}, groups {config.groups}")
    started = time.perf_counter()
    rows = _run(config)
    elapsed = time.perf_counter() - started
    chosen = [WORKLOADS[n] for n in config.workloads]
    text = render_report(chosen, rows, header, elapsed)
    print(text, file=sys.stderr if args.json == "-" else sys.stdout, flush=True)
    if args.json:
        settings = {f.name: getattr(config, f.name) for f in fields(config) if f.name != "repeats"}
        settings["ray_num_cpus"] = RAY_NUM_CPUS
        _write_json(args.json, report_json(chosen, rows, facts, settings, elapsed))
    if args.plot:
        if write_plot(args.plot, rows, header):
            log(f"plot written to {args.plot}")
        else:
            log("--plot: nothing to plot (workloads 1 and 2 have no measured rows)")
    failed = [r for r in rows if r.error and not r.system.startswith("ray RDT")]
    for row in failed:
        log(f"FAILED: w{row.workload} {row.system} @ {row.param}: {row.error}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
