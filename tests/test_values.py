"""Values of every shape arrive equal in value, dtype, shape and identity, over every transport."""

from __future__ import annotations

import pytest
import ray

import raydirect as rd

from actors import check_value

CASES = [
    "dtypes",
    "views",
    "aliasing",
    "numpy",
    "no_tensors",
    "params",
    "grad_state",
    "tied",
    "unusual",
    "unusual_small",
]
TRANSPORTS = ["auto", "cma", "shm", "tcp"]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", CASES)
def test_round_trip_to_actor_and_driver(pair, case, transport):
    p, c = pair
    [ref] = ray.get(p.put.remote(case, transport))
    assert ray.get(c.check_nested.remote(case, [ref])) is None
    assert ray.get(c.check.remote(case, ref)) is None
    assert check_value(case, ray.get(ref)) is None
    assert check_value(case, rd.get(ref, timeout=30)) is None


@pytest.mark.parametrize("method", ["value", "value_tcp", "value_shm"])
def test_decorated_methods(pair, method):
    p, c = pair
    ref = getattr(p, method).remote("dtypes")
    assert ray.get(c.check.remote("dtypes", ref)) is None
    assert check_value("dtypes", ray.get(ref)) is None


def test_tensors_travel_directly_not_through_the_object_store(pair):
    p, c = pair
    before = ray.get(p.stats.remote()).objects_sent
    ref = p.value_tcp.remote("dtypes")
    assert ray.get(c.check.remote("dtypes", ref)) is None
    after = ray.get(p.stats.remote()).objects_sent
    assert after.get("tcp", 0) == before.get("tcp", 0) + 1


def test_value_without_tensors_is_a_plain_object(pair):
    p, _ = pair
    before = ray.get(p.stats.remote()).num_objects
    [ref] = ray.get(p.put.remote("no_tensors"))
    assert ray.get(ref) == {"a": 1, "b": [1, 2, "three"], "c": None}
    assert ray.get(p.stats.remote()).num_objects <= before  # nothing kept for it
