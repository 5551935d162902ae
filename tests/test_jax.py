"""JAX arrays travel like tensors (through DLPack, no copy at either end) and
arrive as JAX arrays; a plug-in registered with data_type=jax.Array sees JAX arrays."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest
import ray
import torch
from ray import cloudpickle

import raydirect as rd

import plugin_transports

jax = pytest.importorskip("jax", reason="jax is not installed (pip install jax)")
jnp = pytest.importorskip("jax.numpy")

# Workers cannot import the tests directory: ship this module's actors by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(plugin_transports)


def make_value() -> dict[str, Any]:
    return {
        "f32": jnp.arange(20_000, dtype=jnp.float32).reshape(200, 100),  # 80 KB: not inline
        "bf16": jnp.linspace(-2, 2, 35, dtype=jnp.bfloat16).reshape(5, 7),
        "i32": jnp.arange(3, dtype=jnp.int32),
        "empty": jnp.zeros((0, 4), dtype=jnp.float32),
        "torch": torch.arange(6, dtype=torch.float64),
        "meta": {"step": 3},
    }


def problem(got: dict[str, Any]) -> str | None:
    want = make_value()
    if set(got) != set(want) or got["meta"] != want["meta"]:
        return f"keys or metadata differ: {sorted(got)}"
    if not torch.equal(got["torch"], want["torch"]):
        return "the torch tensor differs"
    for key in ("f32", "bf16", "i32", "empty"):
        g, w = got[key], want[key]
        if not isinstance(g, jax.Array):
            return f"{key} arrived as {type(g).__name__}, not a JAX array"
        if g.dtype != w.dtype or g.shape != w.shape:
            return f"{key}: {g.dtype}{g.shape} != {w.dtype}{w.shape}"
        if not np.array_equal(np.asarray(g, dtype=np.float32), np.asarray(w, dtype=np.float32)):
            return f"{key}: values differ"
    return None


@ray.remote(num_cpus=0)
class JaxProducer:
    @rd.method
    def auto(self) -> dict[str, Any]:
        return make_value()

    @rd.method(tensor_transport="tcp")
    def tcp(self) -> dict[str, Any]:
        return make_value()

    @rd.method(tensor_transport="pickle_shm_jax")
    def plugin(self) -> dict[str, Any]:
        return make_value()


@ray.remote(num_cpus=0)
class JaxConsumer:
    def check(self, value: dict[str, Any]) -> str | None:
        return problem(value)

    def received(self) -> dict[str, int]:
        return rd.local_stats().objects_received


class JaxPickleShm(plugin_transports.PickleShmTransport):
    """The RDT-style plug-in, registered for JAX arrays: it must see only those."""

    def extract_tensor_transport_metadata(self, obj_id, tensors):
        if not all(isinstance(t, jax.Array) for t in tensors):
            raise TypeError(f"expected JAX arrays, got {[type(t) for t in tensors]}")
        return super().extract_tensor_transport_metadata(obj_id, tensors)


@pytest.fixture(scope="module")
def jax_pair(ray_session):
    p, c = JaxProducer.remote(), JaxConsumer.remote()
    yield p, c
    ray.kill(p)
    ray.kill(c)


@pytest.mark.parametrize(("method", "transport"), [("auto", "cma"), ("tcp", "tcp")])
def test_jax_arrays_round_trip(jax_pair, method, transport):
    p, c = jax_pair
    before = ray.get(c.received.remote()).get(transport, 0)
    assert ray.get(c.check.remote(getattr(p, method).remote())) is None
    assert ray.get(c.received.remote()).get(transport, 0) == before + 1
    assert problem(ray.get(getattr(p, method).remote())) is None  # the driver too


def test_a_jax_typed_plugin_sees_jax_arrays(jax_pair):
    p, c = jax_pair
    rd.register_tensor_transport("pickle_shm_jax", ["cpu"], JaxPickleShm, data_type=jax.Array)
    assert ray.get(c.check.remote(p.plugin.remote())) is None
    assert ray.get(c.received.remote()).get("pickle_shm_jax") == 1
