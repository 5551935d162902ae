"""The examples run as written, each on its own embedded Ray."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

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
