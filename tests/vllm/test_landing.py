"""Direct landing, on models small enough to check by hand: layers whose vLLM
loaders only slice and concatenate receive their bytes straight into the tensors
vLLM's reload processes; a layer whose loader computes goes through its loader.
Loaders written as vLLM's are (item assignment, a scale after the copy, a cast),
and each model served exactly as vLLM's own reload of a twin serves it. Real
Ray, real publishing and receiving, vLLM's real layerwise reload."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
    record_metadata_for_reloading,
)

import raydirect as rd
from raydirect.vllm.landing import Survey, survey, unread_problems
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


# --- loaders as vLLM writes them, checked against vLLM's own reload ----------------


def _copy_then_scale(param: torch.Tensor, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)
    param.data.mul_(2)  # in place after the copy, as loaders applying a scale do


class _Routed(nn.Module):
    """Layers, and the loaders each published name goes to (one name may go to
    several, as a vLLM model's ``load_weights`` routes checkpoint names)."""

    def __init__(self, layers: dict[str, nn.Module], routes: dict[str, list[tuple[Any, ...]]]):
        super().__init__()
        self.layers = nn.ModuleDict(layers)
        self.routes = routes  # name -> (layer, tensor, the loader's further arguments)
        self.calls = 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.calls += 1
        for name, tensor in weights:
            for layer, pname, *more in self.routes[name]:  # KeyError: a name it lacks
                param = getattr(self.layers[layer], pname)
                param.weight_loader(param, tensor, *more)


def _plain(rows: int) -> _Layer:
    return _Layer(rows, _copying)


def _vllm_reload(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    initialize_layerwise_reload(model)
    model.load_weights([(n, t.clone()) for n, t in tensors.items()])  # type: ignore[operator]
    finalize_layerwise_reload(model, None)


def _serves_as_vllm(
    make: Callable[[], nn.Module], layout: list[tuple[str, torch.dtype, tuple[int, ...]]]
) -> Survey:
    """Two versions of ``layout`` through the survey, a ``Receiver`` and the
    worker's ``load``; after each, the model serves exactly what a twin reloaded
    by vLLM itself serves. Returns the survey."""
    ours, twin = make(), make()
    record_metadata_for_reloading(ours)
    record_metadata_for_reloading(twin)
    plan = survey(ours, layout)
    assert not plan.problems, plan.problems
    receiver = Receiver(layout, plan)
    published = {n: torch.zeros(s, dtype=d) for n, d, s in layout}
    publisher = rd.WeightPublisher(published, depth=1)
    for version in (1, 2):  # the second refills the memory the first landed in
        for tensor in published.values():
            tensor.copy_(torch.randn_like(tensor))
        receiver.receive([publisher.publish(version)], timeout=60)
        assert load(ours, None, receiver)
        _vllm_reload(twin, published)
        want = twin.state_dict()
        for name, got in ours.state_dict().items():
            assert torch.equal(got, want[name]), (version, name)
    return plan


def test_a_scale_in_place_after_the_copy_loads(ray_session: None) -> None:
    def make() -> nn.Module:
        return _Routed(
            {"plain": _plain(3), "scaled": _Layer(3, _copy_then_scale)},
            {"plain": [("plain", "weight")], "scaled": [("scaled", "weight")]},
        )

    layout = [("plain", torch.float32, (3, 4)), ("scaled", torch.float32, (3, 4))]
    plan = _serves_as_vllm(make, layout)
    assert list(plan.layers) == ["layers.plain"] and list(plan.lands) == ["plain"]


def _embedding(param: torch.Tensor, loaded: torch.Tensor) -> None:
    # vLLM's VocabParallelEmbedding: the rows, then zeros in the padding (maybe none)
    param[: loaded.shape[0]].data.copy_(loaded)
    param[loaded.shape[0] :].data.fill_(0)


def test_an_embedding_lands_unless_it_fills_padding(ray_session: None) -> None:
    def make() -> nn.Module:
        return _Routed(
            {"exact": _Layer(3, _embedding), "padded": _Layer(5, _embedding)},
            {"exact": [("exact", "weight")], "padded": [("padded", "weight")]},
        )

    layout = [("exact", torch.float32, (3, 4)), ("padded", torch.float32, (3, 4))]
    plan = _serves_as_vllm(make, layout)
    assert list(plan.lands) == ["exact"] and list(plan.layers) == ["layers.exact"]


def test_a_name_copied_into_one_layer_and_computed_from_into_another(ray_session: None) -> None:
    def make() -> nn.Module:
        return _Routed(
            {"copied": _plain(3), "computed": _Layer(3, _scaling), "other": _plain(2)},
            {
                "shared": [("copied", "weight"), ("computed", "weight")],
                "other": [("other", "weight")],
            },
        )

    layout = [("shared", torch.float32, (3, 4)), ("other", torch.float32, (2, 4))]
    plan = _serves_as_vllm(make, layout)
    # landed, ``shared`` would reach no loader: the computing layer would keep old weights
    assert list(plan.lands) == ["other"] and list(plan.layers) == ["layers.other"]


_DBRX = {"w1": "w13_weight", "v1": "w13_weight", "w2": "w2_weight"}  # checkpoint -> param


class _DbrxExperts(nn.Module):
    """vLLM's ``DbrxExperts.weight_loader`` (tensor parallel 1): w1 and v1, each
    (experts * ffn, d_model) in the checkpoint, fill the two halves of the
    stacked w13 and w2 fills w2 transposed, all by item assignment."""

    def __init__(self, experts: int = 2, ffn: int = 3, d_model: int = 4) -> None:
        super().__init__()
        self.intermediate_size, self.d_model = ffn, d_model
        self.w13_weight = nn.Parameter(torch.zeros(experts, 2 * ffn, d_model), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.zeros(experts, d_model, ffn), requires_grad=False)
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, name: str) -> None:
        param_data, shard_size = param.data, self.intermediate_size
        shard = slice(0, shard_size)
        if name.endswith("w1"):
            loaded_weight = torch.reshape(loaded_weight, [-1, shard_size, self.d_model])
            param_data[:, 0:shard_size, :] = loaded_weight[:, shard, :]
        if name.endswith("v1"):
            loaded_weight = torch.reshape(loaded_weight, [-1, shard_size, self.d_model])
            param_data[:, shard_size : 2 * shard_size, :] = loaded_weight[:, shard, :]
        if name.endswith("w2"):
            loaded_weight = torch.reshape(loaded_weight, [-1, shard_size, self.d_model]).transpose(
                1, 2
            )
            param_data[:] = loaded_weight[:, :, shard]


def test_dbrx_experts_written_by_item_assignment(ray_session: None) -> None:
    def make() -> nn.Module:
        routes = {f"ffn.experts.mlp.{w}": [("experts", t, w)] for w, t in _DBRX.items()}
        return _Routed(
            {"experts": _DbrxExperts(), "norm": _plain(1)}, {**routes, "norm": [("norm", "weight")]}
        )

    layout = [(f"ffn.experts.mlp.{w}", torch.float32, (2 * 3, 4)) for w in _DBRX]
    plan = _serves_as_vllm(make, [*layout, ("norm", torch.float32, (1, 4))])
    assert list(plan.layers) == ["layers.norm"]  # reshaped and transposed: loaded
    assert all(plan.reads[n] == ((0, 0), (6, 4)) for n, _d, _s in layout)


class _MoeScales(nn.Module):
    """Fused MoE's per-tensor FP8 scales, written as vLLM's
    ``_load_per_tensor_weight_scale`` writes them: one checkpoint scalar (0-d or
    shape (1,)) per expert and shard, by item assignment; and a per-expert bias
    written by a tensor index (``index_put_``)."""

    def __init__(self, experts: int = 3) -> None:
        super().__init__()
        self.w13_weight_scale = nn.Parameter(torch.zeros(experts, 2), requires_grad=False)
        self.w2_weight_scale = nn.Parameter(torch.zeros(experts), requires_grad=False)
        self.w2_bias = nn.Parameter(torch.zeros(experts, 4), requires_grad=False)
        for param in (self.w13_weight_scale, self.w2_weight_scale, self.w2_bias):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str, expert_id: int
    ) -> None:
        param_data = param.data
        if shard_id in ("w1", "w3"):
            idx = 0 if shard_id == "w1" else 1
            param_data[expert_id][idx] = loaded_weight.reshape(())
        elif shard_id == "w2":
            param_data[expert_id] = loaded_weight.reshape(())
        else:
            param_data[torch.tensor([expert_id])] = loaded_weight[None]


def test_fused_moe_per_tensor_scales_written_by_item_assignment(ray_session: None) -> None:
    experts = 3
    layout, routes = [], {}
    for e in range(experts):
        for shard, shape in (("w1", (1,)), ("w3", ()), ("w2", (1,)), ("bias", (4,))):
            name = f"experts.{e}.{shard}"
            pname = (
                "w2_bias" if shard == "bias" else f"{'w2' if shard == 'w2' else 'w13'}_weight_scale"
            )
            layout.append((name, torch.float32, shape))
            routes[name] = [("moe", pname, shard, e)]

    plan = _serves_as_vllm(lambda: _Routed({"moe": _MoeScales(experts)}, routes), layout)
    assert not plan.layers  # each element written on its own: through the loaders


def test_a_casting_copy_loads(ray_session: None) -> None:
    def make() -> nn.Module:
        return _Routed(
            {"cast": _plain(3), "plain": _plain(2)},
            {"cast": [("cast", "weight")], "plain": [("plain", "weight")]},
        )

    layout = [("cast", torch.float64, (3, 4)), ("plain", torch.float32, (2, 4))]
    plan = _serves_as_vllm(make, layout)  # the loader casts float64 into float32
    assert list(plan.lands) == ["plain"] and list(plan.layers) == ["layers.plain"]


def test_one_load_weights_call_surveys_a_layout_and_a_refusal_is_still_named() -> None:
    toy = _Routed(
        {"a": _plain(3), "b": _plain(2), "c": _Layer(3, _scaling)},
        {n: [(n, "weight")] for n in "abc"},
    )
    record_metadata_for_reloading(toy)
    layout = [(n, torch.float32, (r, 4)) for n, r in (("a", 3), ("b", 2), ("c", 3))]
    plan = survey(toy, layout)
    assert not plan.problems and toy.calls == 1
    assert sorted(plan.lands) == ["a", "b"]

    bad = [*layout[:1], ("b", torch.float32, (5, 4)), layout[2], ("nowhere", torch.float32, (2,))]
    plan = survey(toy, bad)
    refused = [p.split(":")[0] for p in plan.problems[:2]]
    assert refused == ["'b'", "'nowhere'"], plan.problems  # each named, one by one
    assert plan.problems[2:] == [
        "the engine's parameter 'layers.b.weight' is filled by no published tensor"
    ]
    assert not plan.lands


def test_unread_problems_take_every_ranks_reads() -> None:
    shapes = {"wide": (8, 4), "exact": (6, 4), "unused": (3,)}
    reads = [  # two tensor-parallel ranks, each cutting its rows
        {"wide": ((0, 0), (3, 4)), "exact": ((0, 0), (3, 4))},
        {"wide": ((3, 0), (3, 4)), "exact": ((3, 0), (3, 4))},
    ]
    problems = unread_problems(shapes, reads)
    assert len(problems) == 1 and problems[0].startswith("'wide'"), problems
    assert "(8, 4)" in problems[0] and "[0, 6) of dim 0" in problems[0]
    assert not unread_problems(shapes, reads[:1] + [{"wide": ((3, 0), (5, 4))}, reads[1]])


_kept: list[torch.Tensor] = []


def _keeping(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """A loader that holds on to what it was given, as the tensor itself or as a
    view of its memory (vLLM's CPU Zen path without prepacking keeps
    ``weight.detach()`` in its linear's closure). It adds zero, so its layer is
    loaded, not landed: the loader runs on the receiver's memory."""
    param.data.copy_(loaded + 0)
    _kept.append(loaded if len(_kept) % 2 else loaded.detach())


class _Keeper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = _Layer(3, _keeping)

    def load_weights(self, weights: Any) -> None:
        for _name, tensor in weights:
            self.layer.weight.weight_loader(self.layer.weight, tensor)


def test_memory_the_model_keeps_is_never_received_into_again(ray_session: None) -> None:
    """The load says when the model holds on to the receiver's memory: that memory
    is then the engine's, and the worker drops the receiver rather than write the
    next version where the engine may read."""
    keeper, plain = _Keeper(), _Toy()
    for model in (keeper, plain):
        record_metadata_for_reloading(model)
    published = {"w": torch.randn(3, 4)}
    layout = [("w", torch.float32, (3, 4))]
    publisher = rd.WeightPublisher(published, depth=1)
    for version in (1, 2):  # a view of its memory, then the tensor itself
        receiver = Receiver(layout, survey(keeper, layout))
        receiver.receive([publisher.publish(version)], timeout=60)
        assert not load(keeper, None, receiver)
        assert torch.equal(keeper.layer.weight, published["w"])
    _kept.clear()
    toy_layout = [("fused_a", torch.float32, (2, 4)), ("fused_b", torch.float32, (4, 4)),
                  ("scaled", torch.float32, (3, 4))]  # fmt: skip
    toy_published = {n: torch.randn(s) for n, _d, s in toy_layout}
    toy_receiver = Receiver(toy_layout, survey(plain, toy_layout))
    toy_receiver.receive([rd.WeightPublisher(toy_published, depth=1).publish(1)], timeout=60)
    assert load(plain, None, toy_receiver)  # nothing kept: the receiver is reused
