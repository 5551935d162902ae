"""The examples run as written, each on its own embedded Ray."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from helpers import free_port, wait_for

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NEEDS_TRANSFORMERS = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (the test extra installs it)",
)


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("quickstart.py", "driver sees {'weight': (1024, 1024), 'bias': (1024,)}"),
        ("custom_transport.py", "files after the ref is gone: 0"),
        ("weight_sync.py", "all 4 rollouts match the trainer at every step: True"),
        ("two_sided_transport.py", "sends in the producer: 2"),
        ("kv_region.py", "decode read every request's blocks exactly: True"),
        ("pipeline_read_once.py", "a second read: ProducerLostError naming True"),
        pytest.param(
            "weight_sync_model.py",
            "both ranks match the trainer at every step: True",
            marks=NEEDS_TRANSFORMERS,
        ),
        pytest.param(
            "weight_sync_fsdp.py",
            "both workers match the trainer at every step, each receiving its slice: True",
            marks=NEEDS_TRANSFORMERS,
        ),
    ],
)
def test_example_runs(script, expected):
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert expected in done.stdout
    if script == "custom_transport.py":
        assert "{'file': 1}" in done.stdout
    if script == "kv_region.py":  # every block freed on decode's notices
        assert "prefill's free blocks after the notices: 64" in done.stdout


def test_the_pd_proxy_answers_502_when_its_servers_are_gone():
    """examples/vllm_pd_http.py, the P/D proxy, needs no vLLM of its own: with
    nothing listening behind it, a client gets a 502 saying why (its work in
    front of real servers is tested in tests/vllm/test_kv_http.py)."""
    nowhere = f"http://127.0.0.1:{free_port()}"
    port = free_port()
    command = [sys.executable, str(EXAMPLES / "vllm_pd_http.py"), "--prefill", nowhere,
               "--decode", nowhere, "--port", str(port)]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        [reply] = wait_for(lambda: _post(url), timeout=30.0, what="the proxy")
        assert reply.status_code == 502 and "Connection refused" in reply.text, reply.text
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _post(url: str) -> list[requests.Response]:
    """The proxy's answer (in a list: an error response is falsy), or none yet."""
    try:
        return [requests.post(url, json={"model": "m", "prompt": "hi"}, timeout=10)]
    except requests.ConnectionError:  # not listening yet
        return []
