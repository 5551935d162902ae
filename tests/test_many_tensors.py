"""What keeps an object of thousands of tensors cheap, in one process: into=
described ahead and matched by key, layouts kept by content, a Payload small
enough for Ray to inline, and the garbage collector held off during bulk work.
The end-to-end reads these serve run with a real Ray in test_into.py,
test_values.py and test_weights.py."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
import torch
from ray import cloudpickle

from raydirect import _collector, _compression, _payload
from raydirect._into import MatchedTargets, describe_targets, match
from raydirect._payload import Payload, ProducerInfo
from raydirect._producer import _byte_views
from raydirect.errors import TransferError
from raydirect.transports import cma

# Ray returns a value inline, in the task's reply, up to 100 KiB
# (max_direct_call_object_size); a larger one goes through its object store.
RAY_INLINE_LIMIT = 100 * 1024


def _model_state(layers: int) -> dict[str, torch.Tensor]:
    """A small decoder's state dict: 9 tensors a layer, Llama's names and shapes."""
    d, f = 64, 176
    state = {"model.embed_tokens.weight": torch.zeros(1024, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (
            ("input_layernorm.weight", (d,)),
            ("post_attention_layernorm.weight", (d,)),
            ("self_attn.q_proj.weight", (d, d)),
            ("self_attn.k_proj.weight", (d // 4, d)),
            ("self_attn.v_proj.weight", (d // 4, d)),
            ("self_attn.o_proj.weight", (d, d)),
            ("mlp.gate_proj.weight", (f, d)),
            ("mlp.up_proj.weight", (f, d)),
            ("mlp.down_proj.weight", (d, f)),
        ):
            state[p + name] = torch.zeros(shape)
    state["model.norm.weight"] = torch.zeros(d)
    return state


def _payload_of(value: dict[str, torch.Tensor]) -> Payload:
    """The Payload ``export`` makes for ``value``, without an agent: the same
    skeleton, metas and cma addresses."""
    parts = _payload.split(value)
    views = _byte_views(parts.tensors, parts.metas)
    producer = ProducerInfo("tcp://10.0.0.1:40000", "f" * 56, 4242, 1, b"t" * 16, "Trainer.state")
    return Payload(
        obj_id=b"o" * 16,
        capability=b"c" * 16,
        skeleton=parts.skeleton,
        handles=[],
        metas=parts.metas,
        transport="auto",
        producer=producer,
        transport_meta={
            "cma": dict(cma.CmaTransport().extract_tensor_transport_metadata(b"o", views).extra)
        },
    )


def test_5000_tensors_travel_in_a_payload_ray_inlines():
    state = _model_state(555)
    assert len(state) == 4997
    payload = _payload_of(state)
    size = len(cloudpickle.dumps(payload))
    assert size < RAY_INLINE_LIMIT // 2, size  # uncompressed it was 345 KB
    back = cloudpickle.loads(cloudpickle.dumps(payload.metas.pack()))
    assert list(_payload._unpacked_metas(back)) == list(payload.metas)
    assert _payload.state_dict_keys(payload.skeleton) == tuple(state)


def test_layouts_are_kept_by_content_and_shared():
    payload = _payload_of(_model_state(3))
    blob = payload.metas.pack()
    first = _payload._unpacked_metas(bytes(blob))
    assert _payload._unpacked_metas(bytes(bytearray(blob))) is first  # equal bytes, one object
    keys = _payload.state_dict_keys(payload.skeleton)
    assert isinstance(keys, tuple) and _payload.state_dict_keys(bytes(payload.skeleton)) is keys
    assert _payload.state_dict_index(payload.skeleton) == {k: i for i, k in enumerate(keys)}


def test_cma_addresses_round_trip_in_any_order():
    for addresses in (
        np.array([0x7F00_0000_1000, 0x7F00_0000_2040, 0x5500_0000_0000, 0x7FFF_FFFF_F000]),
        np.zeros(0, dtype=np.int64),
        np.arange(5000, dtype=np.int64) * 4160 + 0x7F12_3456_0000,
    ):
        packed = cma._pack_addresses(addresses.astype(np.int64))
        assert isinstance(packed, bytes)
        assert cma._addresses(packed).tolist() == addresses.tolist()
    assert len(cma._pack_addresses(np.arange(5000, dtype=np.int64) * 4160)) < 2000
    with pytest.raises(TransferError, match="corrupt cma metadata"):
        cma._addresses(b"not zlib")


def test_metadata_blobs_are_compressed_only_when_large():
    small, large = b"x" * 100, b"model.layers.0.mlp.up_proj.weight" * 1000
    assert _compression.pack(small) == b"\x00" + small  # a zlib stream costs more
    assert len(_compression.pack(large)) < len(large) // 20
    for raw in (b"", small, large):
        assert _compression.unpack(_compression.pack(raw)) == raw
    for bad in (b"", b"\x07abc", b"\x01not zlib"):
        with pytest.raises(ValueError):
            _compression.unpack(bad)


def test_a_described_state_dict_matches_by_key_in_any_order():
    state = _model_state(2)
    payload = _payload_of(state)
    targets = {k: torch.empty_like(t) for k, t in state.items()}
    described = describe_targets(targets)
    assert described is not None
    found = match(payload, targets, described)
    assert isinstance(found, MatchedTargets)
    assert list(found) == list(range(len(state)))
    assert found.addresses.tolist() == [t.data_ptr() for t in targets.values()]
    assert dict(found) == match(payload, targets)  # what the walk finds
    # A subset, in another order: each target by its key's index.
    keys = list(state)
    some = {k: targets[k] for k in reversed(keys[1:6])}
    found = match(payload, some, describe_targets(some))
    assert isinstance(found, MatchedTargets)
    assert {i: t.data_ptr() for i, t in found.items()} == {
        keys.index(k): t.data_ptr() for k, t in some.items()
    }
    assert found.addresses.tolist() == [t.data_ptr() for t in found.values()]


def test_described_targets_that_do_not_fit_get_the_checks_that_name_them():
    state = _model_state(1)
    payload = _payload_of(state)
    wrong = {k: torch.empty_like(t) for k, t in state.items()}
    wrong["model.norm.weight"] = torch.empty(65)
    with pytest.raises(ValueError, match=r"has shape \(65,\) and dtype float32"):
        match(payload, wrong, describe_targets(wrong))
    unknown = {"model.nope": torch.empty(3)}
    with pytest.raises(ValueError, match="has no counterpart"):
        match(payload, unknown, describe_targets(unknown))
    shared = {k: torch.empty_like(t) for k, t in state.items()}
    shared["model.layers.0.post_attention_layernorm.weight"] = shared[
        "model.layers.0.input_layernorm.weight"
    ]
    assert describe_targets(shared) is None  # two keys, one memory
    with pytest.raises(ValueError, match="names the same memory"):
        match(payload, shared)
    # Not a dict of plain contiguous tensors: not described, walked as before.
    assert describe_targets([torch.empty(3)]) is None
    assert describe_targets({"a": torch.nn.Parameter(torch.empty(3))}) is None
    assert describe_targets({"a": torch.empty(4, 2).t()}) is None
    assert describe_targets({"a": None}) is None


def test_the_collector_is_held_off_while_any_holder_is_inside():
    assert gc.isenabled()
    inside, release = threading.Barrier(3), threading.Event()

    def hold() -> None:
        with _collector.collector_paused():
            inside.wait(timeout=10)
            release.wait(timeout=10)

    threads = [threading.Thread(target=hold) for _ in range(2)]
    for t in threads:
        t.start()
    inside.wait(timeout=10)
    with _collector.collector_paused():  # nested with the others
        assert not gc.isenabled()
    assert not gc.isenabled()  # the two threads are still inside
    release.set()
    for t in threads:
        t.join(timeout=10)
    assert gc.isenabled()


def test_a_collector_the_program_turned_off_stays_off():
    gc.disable()
    try:
        with _collector.collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(KeyError), _collector.collector_paused():
        raise KeyError("inside")
    assert gc.isenabled()  # on again after an error inside
