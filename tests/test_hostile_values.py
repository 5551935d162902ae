"""Property: any nested value (dicts, lists, tuples) holding tensors of any dtype,
shape, stride, view or aliasing arrives exactly, over every transport.

"Exactly": same structure and types, each tensor (or numpy array) equal in
dtype, shape and elements (``raydirect.testing.mismatch``), and the same tensor
object twice in the value arrives as one object. Distinct views of one storage
arrive as distinct tensors (a view sends its own elements, by design).

One producer and one consumer actor (in one gloo group) serve every example;
each example sends a batch of values over every transport in two actor calls.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from ray import cloudpickle

import raydirect as rd
from raydirect.testing import mismatch

TRANSPORTS = ["cma", "shm", "tcp", "gloo"]
EXAMPLES = int(os.environ.get("RAYDIRECT_PROPERTY_EXAMPLES", "150"))  # batches of up to 6 values

# The actors below run in workers, which cannot import this module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def identities(value: Any) -> list[int]:
    """For each tensor/array met in order, the index of its first occurrence:
    equal lists mean the same aliasing of objects."""
    first: dict[int, int] = {}
    out: list[int] = []

    def walk(v: Any) -> None:
        if isinstance(v, (torch.Tensor, np.ndarray)):
            out.append(first.setdefault(id(v), len(first)))
        elif isinstance(v, dict):
            for item in v.values():
                walk(item)
        elif isinstance(v, (list, tuple)):
            for item in v:
                walk(item)

    walk(value)
    return out


def problem(got: Any, want: Any) -> str | None:
    found = mismatch(got, want)
    if found is None and identities(got) != identities(want):
        found = f"aliasing differs: {identities(got)} != {identities(want)}"
    return found


@ray.remote(num_cpus=0)
class Side:
    def put_all(self, values: list[Any], transports: list[str]) -> list[list[ray.ObjectRef]]:
        return [[rd.put(v, tensor_transport=t) for v in values] for t in transports]

    def check_all(self, values: list[Any], refs: list[list[ray.ObjectRef]]) -> list[str | None]:
        out: list[str | None] = []
        for batch in refs:
            got = rd.get(batch, timeout=60)
            out.extend(problem(g, w) for g, w in zip(got, values, strict=True))
        return out

    def received(self) -> dict[str, int]:
        return rd.local_stats().objects_received


@pytest.fixture(scope="module")
def sides(ray_session) -> Iterator[tuple[Any, Any]]:
    producer, consumer = Side.remote(), Side.remote()
    name = rd.create_collective_group([producer, consumer], backend="gloo", name="property")
    yield producer, consumer
    with contextlib.suppress(Exception):
        rd.destroy_collective_group(name)
    ray.kill(producer)
    ray.kill(consumer)


DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
VIEWS = ["plain", "transpose", "step", "narrow", "expand", "select", "permute"]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    shape = draw(st.lists(st.integers(0, 6), max_size=3))
    dtype = draw(st.sampled_from(DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    base = torch.randint(-100, 100, shape, generator=g)
    t = base > 0 if dtype == torch.bool else base.to(dtype)
    view = draw(st.sampled_from(VIEWS))
    if view == "transpose" and t.dim() >= 2:
        t = t.t() if t.dim() == 2 else t.transpose(0, -1)
    elif view == "step" and t.dim() >= 1:
        t = t[::2]
    elif view == "narrow" and t.dim() >= 1 and t.shape[0] > 1:
        t = t[1:]
    elif view == "expand":
        t = t.unsqueeze(0).expand(3, *t.shape)
    elif view == "select" and t.dim() >= 1 and t.shape[0] > 0:
        t = t[t.shape[0] - 1]
    elif view == "permute" and t.dim() == 3:
        t = t.permute(2, 0, 1)
    return t


@st.composite
def values(draw: st.DrawFn) -> list[Any]:
    """A batch of values drawing on one pool of tensors, so the same tensor (or a
    view of another pool member) recurs within and across values."""
    pool: list[Any] = draw(st.lists(tensors(), min_size=1, max_size=6))
    for i in draw(st.lists(st.integers(0, len(pool) - 1), max_size=2)):
        if pool[i].dtype != torch.bfloat16:  # numpy has no bfloat16
            pool.append(pool[i].numpy())
    base = pool[0]
    if base.dim() >= 1 and base.shape[0] > 1:
        pool.append(base[1:])  # a view of a pool member, sent beside it
    leaf = st.one_of(
        st.sampled_from(range(len(pool))).map(lambda i: pool[i]),
        st.integers(),
        st.text(max_size=5),
        st.none(),
    )
    tree = st.recursive(
        leaf,
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.lists(inner, max_size=3).map(tuple)
            | st.dictionaries(st.text(max_size=4), inner, max_size=4)
        ),
        max_leaves=12,
    )
    return draw(st.lists(tree, min_size=1, max_size=6))


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(batch=values())
# Only empty tensors: no byte to read (cma once built its plan from zero runs).
@example(batch=[torch.empty(0, 3), [torch.empty(0)]])
def test_any_value_round_trips_exactly_over_every_transport(sides, batch):
    producer, consumer = sides
    refs = ray.get(producer.put_all.remote(batch, TRANSPORTS), timeout=120)
    # Actor to actor (gloo inside the group) ...
    problems = ray.get(consumer.check_all.remote(batch, refs), timeout=120)
    assert problems == [None] * len(problems), problems
    # ... and to the driver (outside the group: gloo objects fall back to tcp).
    for transport_refs in refs:
        got = rd.get(transport_refs, timeout=60)
        found = [problem(g, w) for g, w in zip(got, batch, strict=True)]
        assert found == [None] * len(found), found


def test_every_transport_was_used(sides):
    _, consumer = sides
    received = ray.get(consumer.received.remote())
    for transport in TRANSPORTS:
        assert received.get(transport, 0) > 0, (transport, received)


def test_one_element_strided_view(sides):
    """Found by the property test: flat bytes of x[::2] of a 2-element tensor."""
    producer, consumer = sides
    t = torch.arange(2.0)[::2]
    refs = ray.get(producer.put_all.remote([t], ["tcp"]), timeout=60)
    assert ray.get(consumer.check_all.remote([t], refs), timeout=60) == [None]


def test_zero_d_numpy_array(sides):
    """Found by the property test: np.ascontiguousarray made 0-d arrays 1-d."""
    producer, consumer = sides
    value = {"scalar": np.array(3.5, dtype=np.float32), "tensor": torch.ones(2)}
    refs = ray.get(producer.put_all.remote([value], ["tcp"]), timeout=60)
    assert ray.get(consumer.check_all.remote([value], refs), timeout=60) == [None]
