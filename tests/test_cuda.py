"""CUDA paths (cuda_ipc, auto on CUDA tensors): run where a GPU is, skip here with the reason."""

from __future__ import annotations

import sys

import pytest
import ray
import torch
from ray import cloudpickle

import raydirect as rd

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none"
)

# Workers cannot import the tests directory (on the H200: "No module named
# 'test_cuda'"): ship this module's functions by value, as tests/gpu does.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _put_cuda(_self, transport: str) -> list:
    return [rd.put({"w": torch.arange(1 << 20, device="cuda", dtype=torch.float32)}, transport)]


def _read(_self, refs: list) -> tuple[str, float, dict]:
    value = ray.get(refs[0])
    return str(value["w"].device), float(value["w"].sum()), rd.local_stats().objects_received


@pytest.mark.parametrize("transport", ["cuda_ipc", "auto"])
def test_cuda_tensor_between_actors_on_one_node(ray_session, transport):
    gpu = ray.remote(num_gpus=0.4)(type("GpuActor", (), {})).options(num_cpus=0)
    a, b = gpu.remote(), gpu.remote()
    [ref] = ray.get(a.__ray_call__.remote(_put_cuda, transport))
    device, total, received = ray.get(b.__ray_call__.remote(_read, [ref]))
    assert device.startswith("cuda") and total == float(sum(range(1 << 20)))
    assert received.get("cuda_ipc") == 1
    ray.kill(a)
    ray.kill(b)
