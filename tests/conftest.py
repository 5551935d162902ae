"""One real local Ray for the whole test session (Ray on 2 cores is slow to start)."""

from __future__ import annotations

import contextlib
import importlib.util
import os

import pytest
import ray
from ray import cloudpickle

from raydirect.transports.shm import sweep_after_shutdown

import actors
from plugin_transports import SHM_DIR, plugin_files

# Workers cannot import the tests directory: ship the helper actors by value.
cloudpickle.register_pickle_by_value(actors)

# tests/vllm runs in its own venv (.venv-vllm: vLLM's CPU build pins its own torch
# and friends), as the second half of `./dev test`; elsewhere it is not collected.
# (Without vLLM, "vllm" finds tests/vllm itself, a namespace package: no origin.)
_vllm = importlib.util.find_spec("vllm")
collect_ignore = [] if _vllm is not None and _vllm.origin is not None else ["vllm"]


@pytest.fixture(scope="session")
def ray_session():
    if not ray.is_initialized():
        ray.init(
            num_cpus=16,
            include_dashboard=False,
            logging_level="warning",
            runtime_env={"env_vars": {"RAYDIRECT_TEST": "1"}},
        )
    yield
    ray.shutdown()
    _leave_no_files_behind()


def _leave_no_files_behind() -> None:
    """Workers killed by the shutdown cannot unlink their segments: sweep them once
    they are gone (what the next raydirect process on a node does), and remove the
    files of the test plug-in transports."""
    sweep_after_shutdown(timeout=30)
    for name in plugin_files():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))


@pytest.fixture(scope="module")
def pair(ray_session):
    """A producer and a consumer actor, shared by the tests of one module."""
    p, c = actors.Producer.remote(), actors.Consumer.remote()
    yield p, c
    ray.kill(p)
    ray.kill(c)


# ---------------------------------------------------------------- root-only tests
#
# The flood, chaos, encryption-capture and multi-node suites need root (network
# namespaces, packet capture). Without it they skip, and a green run would hide
# that: the run ends with one line saying how many ran and, if not, why.

ROOT_ONLY_FIXTURES = {"flooded", "chaos", "captured", "cluster", "cluster3"}
_root_only: dict[str, str] = {}  # nodeid -> "ran" or the skip reason


def pytest_collection_modifyitems(items):
    for item in items:
        if ROOT_ONLY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker("root_only")


def pytest_configure(config):
    config.addinivalue_line("markers", "root_only: needs root (network namespaces, capture)")


def pytest_runtest_logreport(report):
    if "root_only" not in report.keywords:
        return
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _root_only[report.nodeid] = reason.removeprefix("Skipped: ")
    elif report.when == "call":
        _root_only[report.nodeid] = "ran"


def pytest_terminal_summary(terminalreporter):
    if not _root_only:
        return
    ran = sum(1 for v in _root_only.values() if v == "ran")
    skipped = sorted({v for v in _root_only.values() if v != "ran"})
    line = f"root-only tests (network namespaces, packet capture): {ran} ran"
    if skipped:
        line += f", {len(_root_only) - ran} skipped: {'; '.join(skipped)}"
    terminalreporter.write_line(line, yellow=bool(skipped), green=not skipped)
