"""Tensors made under ``torch.inference_mode()`` (most rollout and serving code)
export over every transport, and weight sync publishes them."""

from __future__ import annotations

import sys

import pytest
import ray
import torch
from ray import cloudpickle

import raydirect as rd

import plugin_transports
from plugin_transports import PickleShmTransport

cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(plugin_transports)

BIG = 256 << 10  # bytes: above the inline limit
SMALL = 1 << 10  # inline under auto


def value(nbytes: int) -> dict[str, torch.Tensor]:
    """Made in inference mode, as an engine's forward pass makes its outputs."""
    n = nbytes // 4
    with torch.inference_mode():
        base = torch.arange(n, dtype=torch.float32)
        return {"logits": base * 2, "view": base[1::2], "ids": torch.arange(7)}


def expected(nbytes: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in value(nbytes).items()}


@ray.remote(num_cpus=0)
class Engine:
    def __init__(self) -> None:
        self.publishers: dict[int, rd.WeightPublisher] = {}

    @rd.method
    def generate(self, nbytes: int) -> dict[str, torch.Tensor]:
        return value(nbytes)

    @rd.method
    def generate_in_mode(self, nbytes: int) -> dict[str, torch.Tensor]:
        with torch.inference_mode():  # the export itself runs in inference mode too
            return value(nbytes)

    def put(self, nbytes: int, transport: str) -> list[ray.ObjectRef]:
        with torch.inference_mode():
            return [rd.put(value(nbytes), tensor_transport=transport)]

    def publish(self, version: int, depth: int) -> rd.WeightsHandle:
        """A new version of weights the engine holds as inference tensors (its
        source) published from inside inference mode (its slots made there)."""
        with torch.inference_mode():
            if depth not in self.publishers:
                weights = {"w": torch.zeros(64, 64), "b": torch.zeros(64)}
                self.publishers[depth] = rd.WeightPublisher(weights, depth=depth)
            publisher = self.publishers[depth]
            for t in publisher._source.values():
                t.fill_(float(version))
            return publisher.publish(version, timeout=30)


@ray.remote(num_cpus=0)
class Reader:
    def check(self, got: dict[str, torch.Tensor], nbytes: int) -> str | None:
        want = expected(nbytes)
        for k, t in want.items():
            if not torch.equal(got[k], t):
                return f"{k} differs"
        return None

    def load(self, handles: list[rd.WeightsHandle]) -> list[float]:
        target = {"w": torch.empty(64, 64), "b": torch.empty(64)}
        sub = rd.WeightSubscriber(target)
        out = []
        for handle in handles:
            sub.load(handle, timeout=30)
            out.append(float(target["w"][3, 5]))
        return out


@pytest.fixture(scope="module")
def engine_and_reader(ray_session):
    engine, reader = Engine.remote(), Reader.remote()
    rd.register_tensor_transport("pickle_shm", ["cpu"], PickleShmTransport, replace=True)
    rd.create_collective_group([engine, reader], backend="gloo", name="inference-mode")
    yield engine, reader
    rd.destroy_collective_group("inference-mode")
    ray.kill(engine)
    ray.kill(reader)


@pytest.mark.parametrize("nbytes", [SMALL, BIG], ids=["inline", "direct"])
@pytest.mark.parametrize("method", ["generate", "generate_in_mode"])
def test_an_inference_actors_method_exports_its_outputs(engine_and_reader, method, nbytes):
    engine, reader = engine_and_reader
    ref = getattr(engine, method).remote(nbytes)
    assert ray.get(reader.check.remote(ref, nbytes)) is None
    got = rd.get(ref, timeout=30)
    assert all(torch.equal(got[k], t) for k, t in expected(nbytes).items())


@pytest.mark.parametrize("transport", ["auto", "cma", "shm", "tcp", "gloo", "pickle_shm"])
def test_inference_tensors_travel_over_every_transport(engine_and_reader, transport):
    engine, reader = engine_and_reader
    [ref] = ray.get(engine.put.remote(BIG, transport))
    assert ray.get(reader.check.remote(ref, BIG)) is None
    if transport != "gloo":  # the driver is in no group: it reads gloo objects over tcp
        assert rd.get(ref, timeout=30)["ids"].tolist() == list(range(7))


@pytest.mark.parametrize("depth", [0, 2])
def test_a_weight_publisher_of_inference_tensors(engine_and_reader, depth):
    engine, reader = engine_and_reader
    # depth 0 makes no copy: one version, read before the source is written again
    versions = (1,) if depth == 0 else (1, 2)
    handles = [engine.publish.remote(v, depth) for v in versions]
    assert ray.get(reader.load.remote(handles)) == [float(v) for v in versions]
