"""One real local Ray for the whole test session (Ray on 2 cores is slow to start)."""

from __future__ import annotations

import contextlib
import os

import pytest
import ray
from ray import cloudpickle

from raydirect._producer import INLINE_ENV
from raydirect.transports.shm import sweep_after_shutdown

import actors
from plugin_transports import SHM_DIR, plugin_files

# Workers cannot import the tests directory: ship the helper actors by value.
cloudpickle.register_pickle_by_value(actors)

# The tests exercise the direct paths with small values; ``auto`` would send
# those inline with Ray's reply. tests/test_inline.py covers inlining itself.
# Ray's workers (and the multi-node harness) inherit this environment.
os.environ[INLINE_ENV] = "0"


@pytest.fixture(scope="session")
def ray_session():
    if not ray.is_initialized():
        ray.init(
            num_cpus=16,
            include_dashboard=False,
            logging_level="warning",
            runtime_env={"env_vars": {"RAYDIRECT_TEST": "1", INLINE_ENV: "0"}},
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
