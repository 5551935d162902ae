"""Collective groups of one actor, as Ray accepts them (issue 27, item 1).

Ray's own RDT tests use ``create_collective_group([actor], backend="gloo")`` to
check an actor passing its own gloo-method results to itself, the driver
fetching them, application errors reaching both, and a retried method's result
fetched by the driver. In raydirect the member reads its own objects as the
very tensors it returned (same process, no copy), and every other process
reads them over ``tcp``, the fallback for non-members.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import ray
import torch
from ray import cloudpickle

import raydirect as rd

# The actor below is defined here: ship it to workers by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@ray.remote(num_cpus=0)
class Loner:
    def __init__(self) -> None:
        self.returned: dict[str, torch.Tensor] = {}
        self.attempts = 0

    @rd.method(tensor_transport="gloo")
    def weights(self, key: str) -> dict[str, Any]:
        w = torch.arange(20_000, dtype=torch.float32) * len(key)  # 80 KB: not inline
        self.returned[key] = w
        return {"w": w, "step": 3}

    @rd.method(tensor_transport="gloo")
    def fails(self, message: str) -> torch.Tensor:
        raise ValueError(message)

    @ray.method(max_task_retries=1, retry_exceptions=[ValueError])
    @rd.method(tensor_transport="gloo")
    def fails_first_attempt(self) -> torch.Tensor:
        self.attempts += 1
        if self.attempts == 1:
            raise ValueError("first-attempt failure")
        return torch.arange(30_000, dtype=torch.float32)

    def same_tensors(self, key: str, *values: dict[str, Any]) -> list[bool]:
        """For each value: is it the tensor this actor returned, not a copy?"""
        return [v["w"] is self.returned[key] and v["step"] == 3 for v in values]

    def total(self, value: dict[str, Any]) -> float:
        return float(value["w"].sum())

    def received(self) -> dict[str, int]:
        return dict(rd.local_stats().objects_received)


def _expected(key: str) -> torch.Tensor:
    return torch.arange(20_000, dtype=torch.float32) * len(key)


@pytest.fixture(scope="module")
def loner(ray_session):
    actor = Loner.remote()
    name = rd.create_collective_group([actor], backend="gloo", name="one")
    assert name == "one"
    yield actor
    rd.destroy_collective_group("one")
    ray.kill(actor)


def test_a_member_passes_its_results_to_itself_once_and_several_times(loner):
    before = ray.get(loner.received.remote())
    ref = loner.weights.remote("a")
    assert ray.get(loner.same_tensors.remote("a", ref)) == [True]
    assert ray.get(loner.same_tensors.remote("a", ref, ref)) == [True, True]  # twice in a call
    assert ray.get(loner.same_tensors.remote("a", ref)) == [True]  # and again, later
    nested = ray.get(loner.same_tensors.remote("b", loner.weights.remote("b")))
    assert nested == [True]
    after = ray.get(loner.received.remote())
    # Every read was local: nothing went over gloo, tcp or anything else.
    assert after.get("local", 0) == before.get("local", 0) + 5
    assert {k: v for k, v in after.items() if k != "local"} == {
        k: v for k, v in before.items() if k != "local"
    }


def test_the_driver_reads_a_members_result_over_tcp(loner):
    ref = loner.weights.remote("driver")
    before = rd.local_stats().objects_received.get("tcp", 0)
    got = ray.get(ref)
    assert torch.equal(got["w"], _expected("driver")) and got["step"] == 3
    got = rd.get(ref, timeout=60)
    assert torch.equal(got["w"], _expected("driver"))
    assert rd.local_stats().objects_received.get("tcp", 0) == before + 2
    with pytest.raises(rd.GroupError, match="rd.create_collective_group"):
        rd.get(ref, timeout=60, tensor_transport="gloo")  # the driver is no member


def test_an_application_error_reaches_the_driver_and_the_member(loner):
    ref = loner.fails.remote("test_app_error")
    with pytest.raises(ray.exceptions.RayTaskError, match="test_app_error"):
        ray.get(ref)
    with pytest.raises(ray.exceptions.RayTaskError, match="test_app_error"):
        ray.get(loner.total.remote(ref))
    # Neither hangs, and the group still serves both readers.
    ref = loner.weights.remote("after")
    assert ray.get(loner.total.remote(ref)) == float(_expected("after").sum())
    assert torch.equal(ray.get(ref)["w"], _expected("after"))


def test_a_retried_methods_result_is_fetched_by_the_driver(loner):
    ref = loner.fails_first_attempt.remote()
    before = rd.local_stats().objects_received.get("tcp", 0)
    assert torch.equal(ray.get(ref, timeout=60), torch.arange(30_000, dtype=torch.float32))
    assert rd.local_stats().objects_received.get("tcp", 0) == before + 1


def test_a_group_of_one_is_destroyed_by_its_member_list(ray_session):
    actor = Loner.remote()
    rd.create_collective_group([actor], backend="gloo", name="alone")
    assert ray.get(actor.total.remote(actor.weights.remote("x"))) == float(_expected("x").sum())
    rd.destroy_collective_group([actor])
    with pytest.raises(ray.exceptions.RayTaskError, match="create_collective_group"):
        ray.get(actor.weights.remote("x"))  # in no gloo group any more
    rd.create_collective_group([actor], backend="gloo", name="alone")  # the name is free
    assert ray.get(actor.total.remote(actor.weights.remote("y"))) == float(_expected("y").sum())
    rd.destroy_collective_group("alone")
    ray.kill(actor)
