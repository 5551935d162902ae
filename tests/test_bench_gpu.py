"""benchmarks/gpu.py's CPU-side logic: options, the blocks in order, the report
written as it goes (a run cut short keeps what it finished), and the message
where no GPU is. The transfers themselves need a GPU (docs/gpu.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from rdbench.common import Row  # noqa: E402
from rdbench.gpu_cli import Report, blocks, not_run, parse_args  # noqa: E402


def test_options_and_the_blocks_in_order_nixl_last():
    args = parse_args(["--sizes", "1MiB,64MiB", "--repeats", "2", "--sync-steps", "1"])
    assert args.size_list == [1 << 20, 64 << 20] and args.state_bytes == 256 << 20
    names = [name for name, _ in blocks(args)]
    assert names == ["1MiB", "64MiB", "weight sync, 256MiB", "NIXL, 1MiB", "NIXL, 64MiB"]
    assert [n for n, _ in blocks(parse_args(["--sizes", "1MiB", "--no-nixl"]))] == [
        "1MiB",
        "weight sync, 256MiB",
    ]
    only = parse_args(["--sizes", "1MiB", "--nixl-only"])
    assert [n for n, _ in blocks(only)] == ["NIXL, 1MiB"]
    with pytest.raises(SystemExit):
        parse_args(["--sizes", "3B"])  # not a whole number of int32 elements


def test_the_report_is_written_as_it_stands(tmp_path):
    md, raw = tmp_path / "bench.md", tmp_path / "bench.json"
    args = parse_args(["--sizes", "1MiB", "--md", str(md), "--json", str(raw)])
    report = Report(args, {"cores": 2}, "# a test")
    row = Row(1, "raydirect cuda_ipc", "1MiB", 1 << 20, 1 << 20, cold_s=0.01, times_s=[0.002])
    report.rows += [row, not_run("NIXL, 1MiB", "interrupted (time limit)")]
    report.write()
    assert "raydirect cuda_ipc" in md.read_text() and "interrupted" in md.read_text()
    systems = json.dumps(json.loads(raw.read_text()))
    assert "raydirect cuda_ipc" in systems and "not run: NIXL, 1MiB" in systems


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where no GPU is")
def test_without_a_gpu_it_says_so():
    command = [sys.executable, str(ROOT / "benchmarks/gpu.py"), "--sizes", "1MiB"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr
    done = subprocess.run([*command, "--skip-if-no-gpu"], capture_output=True, timeout=120)
    assert done.returncode == 0
