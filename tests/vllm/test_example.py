"""The vLLM examples run as written and say what they show: examples/vllm_rl_loop.py
(its own Ray, engine and FSDP2 trainer: after each sync the engine's log-probs
moved toward the reward and equal the trainer's) and examples/vllm_pd.py (two
engines, the KV cache handed over by RaydirectConnector). examples/vllm_pd_http.py,
the P/D proxy, runs in tests/vllm/test_kv_http.py, in front of two real servers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE = EXAMPLES / "vllm_rl_loop.py"


def test_vllm_rl_loop_runs():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "the engine's log-probs moved toward the reward at every step: True" in out, out
    assert "the engine's log-probs equal the trainer's after every sync: True" in out, out
    assert out.count("engine vs trainer") == 3, out


def test_vllm_pd_runs():
    """examples/vllm_pd.py: two engines, the KV read from the prefill engine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "vllm_pd.py")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "decode's tokens equal one engine's for every prompt: True" in out, out
    assert "blocks the decode engine read from the prefill engine: 7" in out, out
