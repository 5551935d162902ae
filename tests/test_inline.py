"""Under ``auto``, small values go inline with Ray's reply; larger ones stay direct."""

from __future__ import annotations

import pytest
import ray

import actors
from helpers import wait_for

LIMIT = 64 << 10


@pytest.fixture(scope="module")
def inline_pair(ray_session):
    env = {"runtime_env": {"env_vars": {"RAYDIRECT_INLINE_BYTES": str(LIMIT)}}}
    p = actors.Producer.options(**env).remote()
    c = actors.Consumer.options(**env).remote()
    yield p, c
    ray.kill(p)
    ray.kill(c)


def _held(actor) -> int:
    return ray.get(actor.stats.remote()).num_objects


def _none_held(actor) -> None:
    """Objects of earlier tests are freed once Ray says their refs are gone,
    asynchronously: start from none."""
    wait_for(lambda: _held(actor) == 0, what="objects of earlier tests to be freed")


def test_a_small_value_goes_inline_and_nothing_is_held(inline_pair):
    p, c = inline_pair
    _none_held(p)
    ref = p.value.remote("dtypes")  # about 40 KiB of tensors
    assert ray.get(c.check.remote("dtypes", ref)) is None
    assert actors.check_value("dtypes", ray.get(ref)) is None
    assert _held(p) == 0
    assert ray.get(c.stats.remote()).objects_received == {}


def test_a_value_over_the_limit_stays_in_the_producer(inline_pair):
    p, c = inline_pair
    _none_held(p)
    ref = p.big.remote(LIMIT + 1, 4)
    assert ray.get(c.summarize.remote(ref))[:2] == (LIMIT + 1, 4)
    assert _held(p) == 1
    del ref
    wait_for(lambda: _held(p) == 0, what="the direct object to be freed")


def test_a_named_transport_is_never_inlined(inline_pair):
    p, c = inline_pair
    ref = p.value_tcp.remote("dtypes")
    assert ray.get(c.check.remote("dtypes", ref)) is None
    assert ray.get(c.stats.remote()).objects_received.get("tcp") == 1
    del ref
    _none_held(p)


def test_an_inlined_ref_passed_back_to_its_producer_is_the_same_tensor(inline_pair):
    p, _ = inline_pair
    _none_held(p)
    ref = p.keep.remote("inline", 1000)  # 4 KB: travels inline
    assert _held(p) == 0  # inlined, not held as a direct object
    assert ray.get(p.is_kept.remote("inline", ref)) is True
    # Elsewhere it is a copy of the same values, as for any value.
    assert ray.get(ref).tolist() == list(range(1000))
