"""raydirect against Ray's object store and Ray's RDT, eleven workloads, one Ray session.

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

Every value moved is checked. Tables (markdown, with ratios) go to stdout,
progress lines to stderr. See benchmarks/README.md for what each row means.

    ./dev raydirect bench [--workloads 1,2,3,4,5,6,7,8,9,10,11] [--quick] [--groups ...]
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
from pathlib import Path

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

DEFAULTS = {  # option -> (full run, --quick)
    "sizes": ("4KiB,1MiB,64MiB,512MiB,1GiB", "4KiB,1MiB,64MiB"),
    "state_size": ("256MiB", "32MiB"),
    "consumers": ("1,2,4", "1,2,4"),
    "round_trips": (1000, 200),
    "part_size": ("32MiB", "4MiB"),
    "driver_size": ("512MiB", "64MiB"),
    "repeats": (5, 2),  # REPEATS, QUICK_REPEATS
    "sync_steps": (10, 2),
    "medium_sizes": ("4KiB,64KiB,256KiB,1MiB,4MiB,16MiB", "4KiB,1MiB"),
    "rounds": (40, 3),
    "kv_rounds": (10, 2),
}
REPEATS, QUICK_REPEATS = 5, 2
LARGE_REPEATS = 3  # full run: for operations moving LARGE_REPEATS_FROM bytes or more


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="raydirect bench",
        description=(__doc__ or "").split("\n\n")[0],
        epilog="Defaults in brackets are (full run / --quick).",
    )

    def default(name: str) -> str:
        full, quick = DEFAULTS[name]
        return f"[{full} / {quick}]"

    parser.add_argument(
        "--workloads",
        default="1,2,3,4,5,6,7,8,9,10,11",
        help="which workloads to run, e.g. 1,3 [all]",
    )
    parser.add_argument(
        "--groups",
        default=",".join(DEFAULT_GROUPS),
        help=f"which families of rows to run, of {','.join(GROUPS)} "
        f"[default: {','.join(DEFAULT_GROUPS)}; nixl rows run in a run of their own]",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument("--sizes", help=f"workload 1: comma-separated sizes {default('sizes')}")
    parser.add_argument(
        "--repeats",
        type=int,
        help=f"timed operations after the cold one {default('repeats')}; the full run uses "
        f"{LARGE_REPEATS} where an operation moves {format_size(LARGE_REPEATS_FROM)} or more",
    )
    parser.add_argument(
        "--state-size", help=f"workloads 2, 6, 7: state dict size {default('state_size')}"
    )
    parser.add_argument(
        "--consumers",
        help=f"workloads 2, 6: consumer counts; 7: N -> N for each from 2 {default('consumers')}",
    )
    parser.add_argument(
        "--sync-steps",
        type=int,
        help=f"workloads 2, 6, 7: timed steps after the cold one {default('sync_steps')}",
    )
    parser.add_argument(
        "--round-trips", type=int, help=f"workload 3: round trips {default('round_trips')}"
    )
    parser.add_argument("--part-size", help=f"workload 4: bytes per ref {default('part_size')}")
    parser.add_argument(
        "--driver-size", help=f"workload 5: the driver's tensor {default('driver_size')}"
    )
    parser.add_argument(
        "--json", metavar="PATH", help="write every raw timing here ('-': stdout, tables to stderr)"
    )
    parser.add_argument(
        "--medium-sizes", help=f"workload 8: comma-separated sizes {default('medium_sizes')}"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="workload 8: timed transfers per system, in blocks; 10: interleaved rounds "
        f"{default('rounds')}",
    )
    parser.add_argument(
        "--kv-rounds", type=int, help=f"workload 11: interleaved rounds {default('kv_rounds')}"
    )
    parser.add_argument(
        "--plot", metavar="PNG", help="write GB/s against size (workloads 1 and 2) here"
    )
    args = parser.parse_args(argv)

    def pick(name: str) -> str:
        value = getattr(args, name)
        return str(value if value is not None else DEFAULTS[name][1 if args.quick else 0])

    def ints(text: str, what: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            parser.error(f"{what}: expected comma-separated numbers, got {text!r}")
        if not values or min(values) < 1:
            parser.error(f"{what}: expected positive numbers, got {text!r}")
        return values

    try:
        args.size_list = [parse_size(s) for s in pick("sizes").split(",") if s.strip()]
        args.medium_list = [parse_size(s) for s in pick("medium_sizes").split(",") if s.strip()]
        args.state_bytes = parse_size(pick("state_size"))
        args.part_bytes = parse_size(pick("part_size"))
        args.driver_bytes = parse_size(pick("driver_size"))
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if args.state_bytes < MIB:
        parser.error("--state-size must be at least 1MiB")
    args.workload_list = ints(args.workloads, "--workloads")
    unknown_w = set(args.workload_list) - set(WORKLOADS)
    if unknown_w:
        parser.error(f"unknown workload(s) {sorted(unknown_w)}; choose from {sorted(WORKLOADS)}")
    args.consumer_list = ints(pick("consumers"), "--consumers")
    args.round_trip_count = ints(pick("round_trips"), "--round-trips")[0]
    args.round_count = ints(pick("rounds"), "--rounds")[0]
    args.kv_round_count = ints(pick("kv_rounds"), "--kv-rounds")[0]
    args.group_list = [g.strip() for g in args.groups.split(",") if g.strip()]
    unknown = set(args.group_list) - set(GROUPS)
    if unknown:
        parser.error(f"unknown group(s) {sorted(unknown)}; choose from {GROUPS}")
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.sync_steps is not None and args.sync_steps < 1:
        parser.error("--sync-steps must be at least 1")
    if args.plot:
        missing = plot_available()
        if missing:
            parser.error(missing)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)

    def repeats(nbytes: int) -> int:
        if args.repeats is not None:
            return int(args.repeats)
        if args.quick:
            return QUICK_REPEATS
        return LARGE_REPEATS if nbytes >= LARGE_REPEATS_FROM else REPEATS

    config = Config(
        workloads=sorted(args.workload_list),
        groups=args.group_list,
        sizes=args.size_list,
        repeats=repeats,
        state_bytes=args.state_bytes,
        consumers=args.consumer_list,
        sync_steps=int(args.sync_steps or DEFAULTS["sync_steps"][1 if args.quick else 0]),
        round_trips=args.round_trip_count,
        part_bytes=args.part_bytes,
        driver_bytes=args.driver_bytes,
        medium_sizes=args.medium_list,
        medium_rounds=args.round_count,
        quick=args.quick,
        kv_rounds=args.kv_round_count,
    )
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
    ray.init(
        num_cpus=RAY_NUM_CPUS,
        include_dashboard=False,
        runtime_env={"env_vars": THP_ENV},
        logging_level=logging.WARNING,
    )
    rows = []
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
    elapsed = time.perf_counter() - started
    rows = order_rows(rows)
    chosen = [WORKLOADS[n] for n in config.workloads]
    text = render_report(chosen, rows, header, elapsed)
    print(text, file=sys.stderr if args.json == "-" else sys.stdout, flush=True)
    if args.json:
        settings = {
            "workloads": config.workloads,
            "groups": config.groups,
            "sizes": config.sizes,
            "state_bytes": config.state_bytes,
            "consumers": config.consumers,
            "round_trips": config.round_trips,
            "part_bytes": config.part_bytes,
            "driver_bytes": config.driver_bytes,
            "medium_sizes": config.medium_sizes,
            "medium_rounds": config.medium_rounds,
            "kv_rounds": config.kv_rounds,
            "quick": args.quick,
            "ray_num_cpus": RAY_NUM_CPUS,
        }
        report = report_json(chosen, rows, facts, settings, elapsed)
        if args.json == "-":
            json.dump(report, sys.stdout, indent=2)
            print()
        else:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
            log(f"raw timings written to {args.json}")
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
