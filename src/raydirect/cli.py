"""The ``raydirect`` command: demo, status, bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

_CONNECT_S = 5.0  # to a cluster's GCS port; a reachable one answers in milliseconds


def _demo(args: argparse.Namespace) -> int:
    from raydirect._demo import run_demo

    return run_demo(quick=args.quick)


def _status(args: argparse.Namespace) -> int:
    import ray

    from raydirect._status import collect, format_table, totals

    unreachable = _unreachable(args.address)
    if unreachable is None:
        try:
            ray.init(address=args.address, logging_level=logging.ERROR, log_to_driver=False)
        except ConnectionError as exc:  # "auto" and no cluster: Ray's traceback said it
            unreachable = str(exc).split(".")[0]
    if unreachable is not None:
        print(
            f"raydirect status: no Ray cluster at {args.address!r} ({unreachable}). Start one "
            "(ray start --head), or pass the head's address: --address HOST:PORT (the GCS "
            "port `ray start --head` printed, 6379 by default) or RAY_ADDRESS",
            file=sys.stderr,
        )
        return 2
    status = collect()
    if args.json:
        out = {
            "processes": status.processes,
            "transports": totals(status.processes),
            "pruned": status.pruned,
        }
        print(json.dumps(out, indent=2))
    else:
        print(format_table(status))
    return 0


def _unreachable(address: str) -> str | None:
    """Why nothing answers at a ``HOST:PORT`` address, or None (other forms are
    Ray's to resolve). Ray's own attempt at a closed port retried for minutes."""
    host, _, port = address.rpartition(":")
    if not host or "://" in address or not port.isdigit():
        return None
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=_CONNECT_S):
            return None
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__


def _bench(args: argparse.Namespace) -> int:
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench.py"
    if not script.exists():
        print(
            "raydirect bench runs benchmarks/bench.py from a source checkout of raydirect; "
            "clone the repository and run it there.",
            file=sys.stderr,
        )
        return 2
    return subprocess.call([sys.executable, str(script), *args.rest], env=os.environ.copy())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raydirect", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="move tensors over every transport on an embedded Ray")
    demo.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    demo.set_defaults(func=_demo)
    status = sub.add_parser(
        "status",
        help="objects and bytes held, sent and received per process and transport in a cluster",
    )
    status.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=_status)
    bench = sub.add_parser("bench", help="benchmarks against Ray's object store and RDT")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for benchmarks/bench.py")
    bench.set_defaults(func=_bench)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # every option, --help included, belongs to bench.py
        return _bench(argparse.Namespace(rest=argv[1:]))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
