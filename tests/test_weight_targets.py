"""A subscriber writes where the target's weights are now, or refuses: never into
memory the model no longer uses, never reporting a version it did not write."""

from __future__ import annotations

import mmap
import tempfile
import warnings
from collections.abc import Callable

import pytest
import ray
import torch
from torch.testing._internal.two_tensor import TwoTensor

import raydirect as rd

from actors import Inference, Trainer, make_weights

D = 64


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Linear(D, D))


def _publisher(source: torch.nn.Module) -> Callable[[int], rd.WeightsHandle]:
    """Publishes version ``v`` with every weight equal to ``v``."""
    pub = rd.WeightPublisher(source, depth=2)

    def publish(version: int) -> rd.WeightsHandle:
        with torch.no_grad():
            for t in source.state_dict().values():
                t.fill_(float(version))
        return pub.publish(version, timeout=30)

    return publish


def _all_equal(module: torch.nn.Module, value: float) -> bool:
    return all(bool((t == value).all()) for t in module.state_dict().values())


def _swap_data(target: torch.nn.Module) -> None:
    target[0].weight.data = torch.zeros(D, D)


def _offload_and_reload(target: torch.nn.Module) -> None:
    for p in target.parameters():  # as an engine's sleep mode frees and re-allocates
        shape = p.shape
        p.data = torch.empty(0)
        p.data = torch.full(shape, -1.0)


def _assign(target: torch.nn.Module) -> None:
    target.load_state_dict(_model().state_dict(), assign=True)


def _new_submodule(target: torch.nn.Module) -> None:
    target[1] = torch.nn.Linear(D, D)


@pytest.mark.parametrize(
    "replace", [_swap_data, _offload_and_reload, _assign, _new_submodule], ids=lambda f: f.__name__
)
def test_a_load_writes_the_storage_the_target_holds_now(ray_session, replace):
    source, target = _model(), _model()
    publish = _publisher(source)
    sub = rd.WeightSubscriber(target)
    assert sub.load(publish(1), timeout=30) == 1 and _all_equal(target, 1.0)
    old = {k: t for k, t in target.state_dict().items()}
    replace(target)
    assert sub.load(publish(2), timeout=30) == 2
    assert _all_equal(target, 2.0)  # the weights the model uses now
    replaced = [k for k, t in target.state_dict().items() if t.data_ptr() != old[k].data_ptr()]
    assert replaced and all(bool((old[k] == 1.0).all()) for k in replaced)  # old memory untouched


def test_a_dict_entry_replaced_between_loads(ray_session):
    source = {"w": torch.zeros(D, D), "b": torch.zeros(D)}
    target = {"w": torch.zeros(D, D), "b": torch.zeros(D)}
    pub = rd.WeightPublisher(source, depth=2)
    sub = rd.WeightSubscriber(target)
    source["w"].fill_(1.0)
    sub.load(pub.publish(1), timeout=30)
    old = target["w"]
    target["w"] = torch.zeros(D, D)
    source["w"].fill_(2.0)
    assert sub.load(pub.publish(2), timeout=30) == 2
    assert bool((target["w"] == 2.0).all()) and bool((old == 1.0).all())


def test_a_target_that_no_longer_fits_is_refused_and_the_version_stays(ray_session):
    source, target = _model(), _model()
    publish = _publisher(source)
    sub = rd.WeightSubscriber(target)
    sub.load(publish(1), timeout=30)
    target.half()  # new storage, another dtype
    with pytest.raises(rd.WeightSyncError, match=r"'0.weight'.*float16.*nothing was written"):
        sub.load(publish(2), timeout=30)
    assert sub.version == 1
    assert all(bool((t == 1.0).all()) for t in target.state_dict().values())


def test_param_data_swapped_between_two_loads_in_an_actor(ray_session):
    """The review's reproduction, across processes."""
    trainer, reader = Trainer.remote(4), Inference.remote(4)
    try:
        assert ray.get(reader.load.remote(trainer.publish.remote(1))) == 1
        ray.get(reader.swap_storage.remote())
        ray.get(trainer.step.remote())
        assert ray.get(reader.load.remote(trainer.publish.remote(2))) == 2
        want = make_weights(4)
        for tensor in want.values():
            if tensor.is_floating_point():
                tensor.add_(1.0)
        got = ray.get(reader.state.remote())
        assert all(torch.equal(got[k], want[k]) for k in want)
    finally:
        ray.kill(trainer)
        ray.kill(reader)


def test_targets_that_overlap_in_memory_are_refused_before_a_byte_moves(ray_session):
    """An engine's fused qkv weight with one view's range off by a row: the q and k
    loads overwrote each other's bytes, and the load said the version was in."""
    source = {
        "q": torch.full((8, D), 1.0),
        "k": torch.full((4, D), 2.0),
        "v": torch.full((4, D), 3.0),
    }
    pub = rd.WeightPublisher(source, depth=1)
    fused = torch.zeros(15, D)
    target = {"q": fused[:8], "k": fused[7:11], "v": fused[11:]}
    sub = rd.WeightSubscriber(target)
    with pytest.raises(
        rd.WeightSyncError, match=r"'q' and 'k': the targets overlap in memory.*nothing was written"
    ):
        sub.load(pub.publish(1), timeout=30)
    assert sub.version is None and not fused.any()
    # Rows side by side load; one tensor under two names (tied weights) is no overlap.
    fused = torch.zeros(16, D)
    target = {"q": fused[:8], "k": fused[8:12], "v": fused[12:]}
    assert rd.WeightSubscriber(target).load(pub.publish(2), timeout=30) == 2
    assert [float(t.mean()) for t in target.values()] == [1.0, 2.0, 3.0]
    tied = torch.zeros(4, D)
    source["v"] = source["k"]
    sub = rd.WeightSubscriber({"q": torch.zeros(8, D), "k": tied, "v": tied})
    assert sub.load(pub.publish(3), timeout=30) == 3 and bool((tied == 2.0).all())


def test_a_target_in_read_only_memory_is_refused_before_a_byte_moves(ray_session):
    """A target over a file mapped read-only (torch.frombuffer takes it, with a
    warning): the load's first store into it would kill the process."""
    pub = rd.WeightPublisher({"w": torch.full((4, D), 1.0), "b": torch.full((D,), 2.0)}, depth=1)
    with tempfile.TemporaryFile(dir="/dev/shm") as f:
        f.truncate(4 * D * 4)
        mapped = mmap.mmap(f.fileno(), 4 * D * 4, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        read_only = torch.frombuffer(mapped, dtype=torch.float32).view(4, D)
    bias = torch.zeros(D)
    sub = rd.WeightSubscriber({"w": read_only, "b": bias})
    with pytest.raises(
        rd.WeightSyncError, match=r"'w' is memory this process cannot write.*nothing was written"
    ):
        sub.load(pub.publish(1), timeout=30)
    assert sub.version is None and not bias.any()


@pytest.mark.parametrize("view", ["conjugated", "negated"])
def test_a_lazily_conjugated_or_negated_target_is_refused_before_a_byte_moves(ray_session, view):
    """Such a view's bytes are not the values it shows: bytes written into it read
    back conjugated or negated."""
    weight = torch.full((4, D), 1 + 2j, dtype=torch.complex64)
    pub = rd.WeightPublisher({"w": weight, "scale": torch.tensor(3.0)}, depth=1)
    backing = torch.zeros(4, D, dtype=torch.complex64)
    if view == "conjugated":
        target = {"w": backing.conj(), "scale": torch.zeros(())}
    else:  # a 0-d float view with the negative bit, made with public calls only
        scale = torch.zeros(1, dtype=torch.complex64)
        target = {"w": backing, "scale": scale.conj().imag[0]}
    sub = rd.WeightSubscriber(target)
    with pytest.raises(
        rd.WeightSyncError, match=r"lazily conjugated or negated view.*nothing was written"
    ):
        sub.load(pub.publish(1), timeout=30)
    assert sub.version is None and not backing.any()


@pytest.mark.parametrize("kind", ["sparse_csr", "nested", "TwoTensor"])
def test_a_sparse_nested_or_wrapper_target_or_source_is_refused_by_name(ray_session, kind):
    """Torch's own errors for a sparse or nested target or source named no tensor
    ("Sparse CSR tensors do not have is_contiguous", "copy_() between dense and
    sparse"). A wrapper subclass's data_ptr() is 0: a load into one failed midway
    ("Bad address") with the target partly written, and a publisher of one
    published its second tensor's values as its own."""
    pub = rd.WeightPublisher({"w": torch.ones(4, D), "b": torch.ones(D)}, depth=1)
    bias = torch.zeros(D)
    odd: torch.Tensor
    if kind == "sparse_csr":
        odd = torch.zeros(4, D).to_sparse_csr()
    elif kind == "nested":
        odd = torch.nested.nested_tensor([torch.zeros(D)] * 4)
    else:
        odd = TwoTensor(torch.zeros(4, D), torch.zeros(4, D))
    named = rf"a {kind} tensor" if kind != "TwoTensor" else r"a TwoTensor \(a tensor subclass"
    with pytest.raises(rd.WeightSyncError, match=rf"'w': the target is {named}"):
        rd.WeightSubscriber({"w": odd, "b": bias})
    with pytest.raises(rd.WeightSyncError, match=rf"'w' is {named}"):
        rd.WeightPublisher({"w": odd, "b": bias})
    target = {"w": torch.zeros(4, D), "b": bias}
    sub = rd.WeightSubscriber(target)
    assert sub.load(pub.publish(1), timeout=30) == 1
    target["w"] = odd  # swapped in between loads: the next load reads the target again
    with pytest.raises(rd.WeightSyncError, match=rf"'w': the target is {named}"):
        sub.load(pub.publish(2), timeout=30)
    assert sub.version == 1
