"""One real local Ray for the whole test session (Ray on 2 cores is slow to start)."""

from __future__ import annotations

import pytest
import ray
from ray import cloudpickle

import actors

# Workers cannot import the tests directory: ship the helper actors by value.
cloudpickle.register_pickle_by_value(actors)


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


@pytest.fixture(scope="module")
def pair(ray_session):
    """A producer and a consumer actor, shared by the tests of one module."""
    p, c = actors.Producer.remote(), actors.Consumer.remote()
    yield p, c
    ray.kill(p)
    ray.kill(c)
