"""rd.get(ref, into=...) and rd.set_target: tensors land in the caller's own memory."""

from __future__ import annotations

import mmap

import pytest
import ray
import torch
from torch.testing._internal.two_tensor import TwoTensor

import raydirect as rd

import actors
from actors import check_value, make_value


@pytest.mark.parametrize("method", ["value", "value_tcp", "value_shm"])
@pytest.mark.parametrize("case", ["dtypes", "views", "params", "large"])
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
        (_targets(c64=torch.empty(64, 32, dtype=torch.complex64).conj()), "lazily conjugated"),
        # A 0-d float view with the negative bit, made with public calls only.
        (_targets(zero_d=torch.zeros(1, dtype=torch.complex64).conj().imag[0]), "negated view"),
        (_targets(f32=torch.zeros(64, 32).to_sparse_csr()), "is a sparse_csr tensor"),
        (_targets(f32=torch.zeros(64, 32).to_sparse()), "is a sparse_coo tensor"),
        (_targets(f32=torch.nested.nested_tensor([torch.zeros(32)] * 64)), "is a nested tensor"),
        # Its data_ptr() is 0: the kernel's write there failed ("Bad address"), shm's crashed.
        (_targets(f32=TwoTensor(torch.zeros(64, 32), torch.zeros(64, 32))), "is a TwoTensor"),
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
        "conjugated-view",
        "negated-view",
        "sparse-csr",
        "sparse-coo",
        "nested",
        "wrapper-subclass",
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


@pytest.mark.parametrize("method", ["value", "value_tcp", "value_shm"])
def test_device_cpu_receives_every_tensor_on_the_cpu(pair, method):
    p, _ = pair
    ref = getattr(p, method).remote("params")
    got = rd.get(ref, device="cpu", timeout=60)
    assert check_value("params", got) is None
    assert all(t.device.type == "cpu" for t in got.values() if isinstance(t, torch.Tensor))


def test_device_applies_to_values_that_came_back_inline(pair):
    p, _ = pair
    ref = p.value.remote("dtypes")  # small enough to travel inside Ray's reply
    got = rd.get(ref, device="cpu", timeout=60)
    assert check_value("dtypes", got) is None


def test_device_on_the_producer_itself_gives_its_own_tensors(ray_session):
    t = torch.arange(1 << 16, dtype=torch.float32)
    ref = rd.put({"t": t})
    assert rd.get(ref, device="cpu")["t"].data_ptr() == t.data_ptr()  # no copy: already there


@pytest.mark.parametrize(
    ("device", "error", "expected"),
    [
        ("gpu0", ValueError, "not a device torch knows"),
        ("meta", ValueError, "receives onto 'cpu' or 'cuda'"),
        pytest.param(
            "cuda:0",
            ValueError,
            "sees no CUDA device",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA"),
        ),
    ],
)
def test_a_bad_device_is_refused_before_a_byte_moves(pair, device, error, expected):
    p, _ = pair
    ref = p.value_tcp.remote("dtypes")
    ray.wait([ref])
    before = rd.local_stats().bytes_received
    with pytest.raises(error, match=expected):
        rd.get(ref, device=device)
    with pytest.raises(error, match=expected):
        rd.set_target(ref, device=device)
    assert rd.local_stats().bytes_received == before
    with pytest.raises(TypeError, match="into= or device="):
        rd.get(ref, into=make_value("dtypes"), device="cpu")
    assert check_value("dtypes", rd.get(ref, timeout=60)) is None  # the ref still reads


def test_set_target_with_a_device_serves_a_plain_ray_get(pair):
    p, _ = pair
    ref = p.value.remote("views")
    rd.set_target(ref, device="cpu")
    got = ray.get(ref)
    assert check_value("views", got) is None


def _large_targets(overlap: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Targets for the "large" value, "f32" and "view" in one buffer, the second
    starting ``overlap`` elements before the first ends."""
    value = make_value("large")
    n, m = value["f32"].numel(), value["view"].numel()
    buf = torch.zeros(n + m)
    return buf, {
        "f32": buf[:n].view(value["f32"].shape),
        "i64": torch.empty(value["i64"].shape, dtype=torch.int64),
        "view": buf[n - overlap : n - overlap + m],
    }


@pytest.mark.parametrize("form", ["dict", "flat-list"])
def test_targets_that_overlap_in_memory_are_refused_before_any_byte_moves(pair, form):
    """Two views of one buffer that share bytes: each read overwrote the other's, and
    the value came back with wrong bytes in one of them, nothing said."""
    p, _ = pair
    ref = p.value.remote("large")
    ray.wait([ref])
    buf, targets = _large_targets(overlap=100)
    into = targets if form == "dict" else list(targets.values())
    before = rd.local_stats().bytes_received
    with pytest.raises(ValueError, match="tensors 0 and 2 of the object overlap in memory"):
        rd.get(ref, into=into, timeout=60)
    assert rd.local_stats().bytes_received == before and not buf.any()
    buf, targets = _large_targets(overlap=0)  # side by side: fine
    got = rd.get(ref, into=targets if form == "dict" else list(targets.values()), timeout=60)
    assert check_value("large", got) is None and got["view"] is targets["view"]


def test_targets_of_two_refs_that_overlap_in_memory_are_refused(pair):
    p, _ = pair
    refs = [p.value.remote("large"), p.value.remote("large")]
    buf, first = _large_targets(overlap=0)
    second = {"f32": buf[10 : 10 + first["f32"].numel()].view(first["f32"].shape)}
    with pytest.raises(ValueError, match="tensor 0 of ref 0 and tensor 0 of ref 1 overlap"):
        rd.get(refs, into=[first, second], timeout=60)
    assert not buf.any()
    got = rd.get(refs, into=[first, None], timeout=60)
    assert all(check_value("large", v) is None for v in got)


@pytest.mark.parametrize("method", ["value", "value_tcp"])
def test_two_targets_for_a_tensor_the_value_holds_twice_are_refused(pair, method):
    """A value with tied weights ({"embed": t, "lm_head": t}) read into a model
    whose two tensors are apart: only the second target was written, the first
    kept its old bytes, nothing said."""
    p, _ = pair
    ref = getattr(p, method).remote("tied")
    value = make_value("tied")
    embed, head = torch.zeros_like(value["embed"]), torch.zeros_like(value["lm_head"])
    targets = {"embed": embed, "norm": torch.empty_like(value["norm"]), "lm_head": head}
    with pytest.raises(ValueError, match=r"into\['lm_head'\] and another target .* twice"):
        rd.get(ref, into=targets, timeout=60)
    assert not embed.any() and not head.any()
    # One tensor under both names (a tied model's state_dict(): two detached views) loads.
    targets["lm_head"] = embed.detach()
    got = rd.get(ref, into=targets, timeout=60)
    assert check_value("tied", got) is None and got["embed"] is embed
    assert torch.equal(embed, value["embed"])


@pytest.mark.parametrize("transport", ["cma", "shm", "tcp"])
@pytest.mark.parametrize("case", ["dtypes", "large"])  # inline in the ref, and a direct object
def test_a_target_in_read_only_memory_is_refused_before_a_byte_moves(pair, case, transport):
    """A target over a file mapped read-only (torch.frombuffer takes it, with a
    warning): a copy out of the ref, an shm segment or a small tcp reply killed
    the consumer with SIGSEGV, and cma and streamed tcp failed with 'Bad address'."""
    p, c = pair
    ref = p.value.remote(case)
    said = ray.get(c.get_into_mapped.remote(case, [ref], transport, mmap.ACCESS_READ))
    assert isinstance(said, str) and said.startswith("ValueError: into= target for tensor 0"), said
    assert "cannot write (a read-only mapping" in said and "mmap.ACCESS_COPY" in said, said
    # The fix the error names: the same file mapped copy-on-write.
    got = ray.get(c.get_into_mapped.remote(case, [ref], transport, mmap.ACCESS_COPY))
    assert got == {"problem": None, "targets_returned": True}


def test_into_a_value_holding_conjugated_sparse_and_nested_tensors(pair):
    """Lazily conjugated views travel as resolved copies, so they land in targets
    like any dense tensor; sparse and nested tensors travel whole (pickled), and
    a target for one is refused by name before a byte moves."""
    p, c = pair
    ref = p.value.remote("unusual")
    targets = {
        "plain": torch.empty(64, 32),
        "conj": torch.empty(64, 32, dtype=torch.complex64),
        "big_conj": torch.empty(256, 128, dtype=torch.complex64),
    }
    got = rd.get(ref, into=targets, timeout=30)
    assert all(got[k] is t for k, t in targets.items())
    assert check_value("unusual", got) is None
    error = ray.get(c.get_into_bad.remote([ref], {"coo": torch.empty(64, 32)}))
    assert error.startswith("TypeError: into['coo']: the value's tensor there is a sparse_coo"), (
        error
    )
    assert "[bytes moved]" not in error
    error = ray.get(c.get_into_bad.remote([ref], {"wrapper": torch.empty(32)}))
    assert "is a TwoTensor (a tensor subclass that computes its values)" in error, error
