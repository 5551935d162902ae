"""``RaydirectConnector`` across two nodes, encrypted: the prefill engine (P) on
node B, the decode engine (D) on node A of the multi-node harness (two Ray nodes
in network namespaces, tests/multinode/mn_harness.py), every engine process with
``RAYDIRECT_ENCRYPT=1``. One driver run (mn_kv_driver.py, inside node A's
namespace) hands prompts from P to D; the tests assert on its report.

Needs root (network namespaces), as tests/multinode does; skips, saying why,
where they are refused. The harness runs Ray and the driver with this venv's
Python, so both nodes have vLLM."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import TINY_LLAMA

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multinode"))
import mn_harness  # noqa: E402

DRIVER = Path(__file__).with_name("mn_kv_driver.py")
LENGTHS = ("45", "100")
BLOCK = 32
HEAD_DIM = TINY_LLAMA["hidden_size"] // TINY_LLAMA["num_attention_heads"]
# One block of a prompt's KV, every layer: K and V of each KV head, float32.
BLOCK_BYTES = (
    TINY_LLAMA["num_hidden_layers"] * TINY_LLAMA["num_key_value_heads"] * BLOCK * 2 * HEAD_DIM * 4
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[mn_harness.Cluster]:
    """Two Ray nodes (the name marks the tests root-only, tests/conftest.py)."""
    reason = mn_harness.unavailable_reason()
    if reason:
        pytest.skip(f"multi-node tests skipped: {reason}")
    with mn_harness.started() as nodes:
        yield nodes


@pytest.fixture(scope="module")
def report(cluster: mn_harness.Cluster, tmp_path_factory: pytest.TempPathFactory) -> dict:
    model = tmp_path_factory.mktemp("mn-llama")
    return cluster.run_driver(DRIVER, str(model), timeout=500)


def test_prefill_and_decode_are_on_distinct_nodes_and_encrypt(report: dict[str, Any]) -> None:
    assert report["p"]["ip"] == mn_harness.ADDR_WORKER
    assert report["d"]["ip"] == mn_harness.ADDR_HEAD
    assert report["p"]["encryption"] in ("tls", "ktls")
    assert report["d"]["encryption"] in ("tls", "ktls")


SEAL_BYTES = 8  # the hand-off's seal word, read after the blocks


@pytest.mark.parametrize("length", LENGTHS)
def test_decode_reads_the_kv_over_tcp(report: dict[str, Any], length: str) -> None:
    """D read every block of the prompt from P, in one read over tcp (the
    encrypted stream port: nothing else crosses nodes under encryption), then
    the hand-off's seal word (8 bytes: P had not freed them), and answers as a
    single engine."""
    handoff = report[length]
    assert handoff["blocks"] == -(-int(length) // BLOCK)
    assert handoff["objects"] == {"tcp": 2}, handoff
    assert handoff["bytes"] == {"tcp": handoff["blocks"] * BLOCK_BYTES + SEAL_BYTES}, handoff
    [read] = handoff["reads"]
    assert read["blocks"] == handoff["blocks"]
    assert read["bytes"] == handoff["bytes"]["tcp"] - SEAL_BYTES
    assert handoff["reason"] == "length" and handoff["tokens"] == handoff["alone"]


@pytest.mark.parametrize("length", LENGTHS)
def test_prefill_frees_the_blocks_on_the_notice(report: dict[str, Any], length: str) -> None:
    handoff = report[length]
    assert handoff["freed"] and handoff["freed_before_lease"], handoff


def test_prefill_served_the_bytes_over_tcp(report: dict[str, Any]) -> None:
    total = sum(report[n]["bytes"]["tcp"] for n in LENGTHS)
    assert report["p"]["sent"].get("tcp", 0) >= total, report["p"]
