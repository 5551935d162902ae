"""rd.get(ref, into=...) and rd.set_target: tensors land in the caller's own memory."""

from __future__ import annotations

import pytest
import ray
import torch

import actors
from actors import make_value


@pytest.mark.parametrize("method", ["value", "value_tcp", "value_shm"])
@pytest.mark.parametrize("case", ["dtypes", "views", "params"])
def test_into_receives_into_the_given_tensors(pair, method, case):
    p, c = pair
    ref = getattr(p, method).remote(case)
    result = ray.get(c.get_into.remote(case, [ref]))
    assert result == {"problem": None, "targets_returned": True}


def test_into_when_the_producer_reads_its_own_object(pair):
    p, _ = pair
    ref = p.value.remote("dtypes")
    result = ray.get(p.__ray_call__.remote(actors.own_read, [ref]))
    assert result == {"problem": None, "targets_returned": True}


def _targets(**changes):
    value = make_value("dtypes")
    targets = {k: torch.empty(t.shape, dtype=t.dtype) for k, t in value.items()}
    targets.update(changes)
    return targets


@pytest.mark.parametrize(
    ("targets", "expected"),
    [
        (_targets(f32=torch.empty(64, 31)), "has shape (64, 31) and dtype float32"),
        (_targets(f32=torch.empty(64, 32, dtype=torch.float64)), "dtype float64"),
        (_targets(f32=torch.empty(32, 64).t()), "must be contiguous"),
        (_targets(extra=torch.empty(3)), "into['extra'] has no counterpart"),
        (_targets(f32="not a tensor"), "must be a tensor or numpy array"),
        (torch.empty(3), "the object holds 11 tensors"),
        ([torch.empty(3)], "fits neither form: the value is a dict"),
        ([torch.empty(3)] * 12, "or a flat list of 11 tensors"),
    ],
    ids=[
        "shape",
        "dtype",
        "non-contiguous",
        "extra-key",
        "not-a-tensor",
        "one-tensor",
        "list-of-1",
        "list-of-12",
    ],
)
def test_mismatching_targets_are_refused_before_any_byte_moves(pair, targets, expected):
    p, c = pair
    ref = p.value.remote("dtypes")
    error = ray.get(c.get_into_bad.remote([ref], targets))
    assert expected in error and "[bytes moved]" not in error, error
    assert error.split(":")[0] in ("ValueError", "TypeError")
    # The same consumer still reads the object.
    assert ray.get(c.get_into.remote("dtypes", [ref])) == {
        "problem": None,
        "targets_returned": True,
    }


@pytest.mark.parametrize("as_tuple", [False, True], ids=["list", "tuple"])
@pytest.mark.parametrize("case", ["dtypes", "params"])
def test_a_flat_list_of_targets_as_ray_takes_it(pair, case, as_tuple):
    """rd.get(ref, into=list(params.values())) on a dict of tensors (Ray's form)."""
    p, c = pair
    ref = p.value.remote(case)
    result = ray.get(c.__ray_call__.remote(actors.flat_read, [ref], case, as_tuple))
    assert result == {"problem": None, "targets_returned": True}


def test_partial_targets_receive_the_rest_as_usual(pair):
    p, c = pair
    ref = p.value.remote("dtypes")
    value = make_value("dtypes")
    targets = {"f32": torch.empty(value["f32"].shape)}
    got = ray.get(c.__ray_call__.remote(actors.partial_read, [ref], targets))
    assert got == (True, None)


def test_set_target_serves_a_task_argument(pair):
    p, c = pair
    ref = p.value.remote("params")
    ray.get(c.hint.remote("params", [ref]))
    result = ray.get(c.read_hinted_arg.remote("params", ref))
    assert result == {"problem": None, "targets_returned": True}


def test_set_target_refuses_a_plain_object(pair):
    _, c = pair
    plain = ray.put({"x": 1})
    error = ray.get(c.__ray_call__.remote(actors.hint_plain, [plain]))
    assert error.startswith("ValueError") and "holds no raydirect tensors" in error
