"""Direct landing, on a model small enough to check by hand: layers whose vLLM
loaders only slice and concatenate receive their bytes straight into the tensors
vLLM's reload processes; a layer whose loader computes goes through its loader.
Real Ray, real publishing and receiving, vLLM's real layerwise reload."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

import raydirect as rd
from raydirect.vllm.landing import survey
from raydirect.vllm.staging import Receiver
from raydirect.vllm.worker import load


def _concatenating(param: torch.Tensor, loaded: torch.Tensor, shard: str) -> None:
    start = 0 if shard == "a" else 2  # a fused qkv in small: a then b, by rows
    param.data.narrow(0, start, loaded.shape[0]).copy_(loaded)


def _copying(param: torch.Tensor, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)


def _scaling(param: torch.Tensor, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded * 2)  # a value the loader makes: no landing can do it


class _Layer(nn.Module):
    def __init__(self, rows: int, loader: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, 4), requires_grad=False)
        self.weight.weight_loader = loader  # type: ignore[attr-defined]


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fused = _Layer(6, _concatenating)
        self.scaled = _Layer(3, _scaling)

    def load_weights(self, weights: Any) -> None:
        for name, tensor in weights:
            if name.startswith("fused_"):
                self.fused.weight.weight_loader(self.fused.weight, tensor, name[-1])
            else:
                self.scaled.weight.weight_loader(self.scaled.weight, tensor)


def test_plain_layers_land_and_a_computing_one_loads(ray_session: None) -> None:
    toy = _Toy()
    record_metadata_for_reloading(toy)
    serving = toy.fused.weight, toy.scaled.weight
    published = {
        "fused_a": torch.zeros(2, 4),
        "fused_b": torch.zeros(4, 4),
        "scaled": torch.zeros(3, 4),
    }
    layout = [(n, t.dtype, tuple(t.shape)) for n, t in published.items()]

    plan = survey(toy, layout)
    assert not plan.problems
    assert sorted(plan.lands) == ["fused_a", "fused_b"] and list(plan.layers) == ["fused"]
    receiver = Receiver(layout, plan)
    assert receiver.landed_bytes == 6 * 4 * 4
    assert [name for name, _ in receiver.weights()] == ["scaled"]

    publisher = rd.WeightPublisher(published, depth=1)
    for version in (1, 2):  # the second refills the memory the first landed in
        for tensor in published.values():
            tensor.copy_(torch.randn_like(tensor))
        receiver.receive([publisher.publish(version)], timeout=60)
        assert load(toy, None, receiver)
        # vLLM's reload copied into the very tensors the engine serves from
        assert toy.fused.weight is serving[0] and toy.scaled.weight is serving[1]
        fused = torch.cat([published["fused_a"], published["fused_b"]])
        assert torch.equal(toy.fused.weight, fused)
        assert torch.equal(toy.scaled.weight, published["scaled"] * 2)


class _Tied(nn.Module):
    """Tied embeddings: the head shares the embedding's tensor and, as vLLM's
    models do, the loader skips the head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = _Layer(5, _copying)
        self.head = _Layer(5, _copying)
        self.head.weight = self.embed.weight

    def load_weights(self, weights: Any) -> None:
        for _name, tensor in weights:
            self.embed.weight.weight_loader(self.embed.weight, tensor)


def test_a_tied_tensor_is_filled_through_its_twin(ray_session: None) -> None:
    tied = _Tied()
    record_metadata_for_reloading(tied)
    published = {"embed": torch.randn(5, 4)}
    layout = [("embed", torch.float32, (5, 4))]

    plan = survey(tied, layout)
    assert not plan.problems  # the head's stand-in is its twin's, filled
    assert not plan.layers  # shared: through the loader, not landed
    assert plan.retie == ["head"]  # its processing is redone from the new values
    receiver = Receiver(layout, plan)
    receiver.receive([rd.WeightPublisher(published, depth=1).publish(1)], timeout=60)
    assert load(tied, None, receiver)
    assert tied.head.weight is tied.embed.weight
    assert torch.equal(tied.head.weight, published["embed"])
