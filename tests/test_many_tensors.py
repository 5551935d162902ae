"""What keeps an object of thousands of tensors cheap, in one process: into=
described ahead and matched by key, a Payload small enough for Ray to inline
(its keys decoded once), and the garbage collector held off during bulk work.
The end-to-end reads these serve run with a real Ray in test_into.py,
test_values.py and test_weights.py."""

from __future__ import annotations

import gc
import os
import threading

import numpy as np
import pytest
import torch
from ray import cloudpickle

from raydirect import _collector, _compression, _payload, _region_reads, _split
from raydirect._into import MatchedTargets, describe_targets, match
from raydirect._payload import Payload, ProducerInfo
from raydirect._producer import _byte_views
from raydirect._ranges import ByteViews, Ranges
from raydirect._tensors import TensorMetas
from raydirect.errors import TransferError
from raydirect.transports import cma
from raydirect.transports.base import PeerMetadata

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
    parts = _split.split(value)
    views = _byte_views(parts)
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
    assert list(TensorMetas.unpack(back)) == list(payload.metas)
    assert _split.state_dict_keys(payload.skeleton) == tuple(state)


def test_a_rebuilt_payload_holds_its_state_dict_s_keys_decoded():
    """Rebuilt in a consumer, a state dict's Payload carries its keys, decoded
    once for matching into= and for joining; other values keep their skeleton."""
    state = _model_state(2)
    payload = _payload_of(state)
    func, args = payload.__reduce__()
    _payload.deferred.active = True  # as rd.get rebuilds: nothing fetched
    try:
        rebuilt = func(*args).payload
    finally:
        _payload.deferred.active = False
    assert rebuilt.skeleton == tuple(state)
    assert list(rebuilt.metas) == list(payload.metas)
    tensors = list(state.values())
    assert _split.join(rebuilt.skeleton, tensors, []) == state
    assert _split.join(payload.skeleton, tensors, []) == state  # from the bytes alike


def test_metas_of_the_tensors_sent_unpack_whatever_changed():
    """Packed columns unpack to the metas of the tensors sent: shapes shared by
    many tensors, a changed shape, dtype or grad flag, 0-d and empty tensors."""
    state = _model_state(3)
    changes = {
        "same": dict(state),
        "shape": {**state, "model.norm.weight": torch.zeros(65)},
        "dtype": {**state, "model.norm.weight": torch.zeros(64, dtype=torch.float16)},
        "grad": {**state, "model.norm.weight": torch.zeros(64, requires_grad=True)},
        "odd": {**state, "scalar": torch.tensor(1.0), "empty": torch.zeros(0, 3)},
    }
    packed = {}
    for what, value in changes.items():
        metas = _split.split(value).metas
        packed[what] = metas.pack()
        back = TensorMetas.unpack(packed[what])
        assert list(back) == list(metas), what
        assert all(type(s) is tuple for s in back.shapes), what
    assert len(set(packed.values())) == len(packed)


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


def _own_link() -> PeerMetadata:
    me = ProducerInfo("tcp://127.0.0.1:1", "n", os.getpid(), 1, b"t" * 16, "itself")
    return PeerMetadata(producer=me, capability=b"", same_node=True)


@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_a_cross_memory_read_shared_among_threads_lands_every_byte(monkeypatch, threads):
    """process_vm_readv from this very process: small tensors on 4 KiB pages and a
    large one, read whole by 1, 2 and 3 threads, each share its own calls."""
    monkeypatch.setenv(cma.THREADS_ENV, threads)
    g = torch.Generator().manual_seed(5)
    sources = [torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g) for n in (4097,) * 900]
    sources.append(torch.randint(0, 255, (40 << 20,), dtype=torch.uint8, generator=g))
    dests = [torch.zeros_like(t) for t in sources]
    lengths = np.array([t.numel() for t in sources], dtype=np.int64)
    ranges = Ranges.of_whole(
        ByteViews(np.array([t.data_ptr() for t in dests]), lengths, dests.__getitem__)
    )
    spans = cma._Spans(*ranges.runs(np.array([t.data_ptr() for t in sources])))
    assert cma.threads_for(int(lengths.sum())) == int(threads)
    cma.read_remote(os.getpid(), spans, _own_link())
    assert all(torch.equal(d, s) for d, s in zip(dests, sources, strict=True))


def test_threads_by_size_and_a_bad_setting_named(monkeypatch):
    monkeypatch.delenv(cma.THREADS_ENV, raising=False)
    assert cma.threads_for(1 << 20) == 1  # a thread hand-off costs more than it saves
    assert 1 <= cma.threads_for(1 << 30) <= cma._MAX_AUTO_THREADS
    monkeypatch.setenv(cma.THREADS_ENV, "0")
    assert cma.threads_for(1 << 30) == 1
    monkeypatch.setenv(cma.THREADS_ENV, "lots")
    with pytest.raises(ValueError, match="RAYDIRECT_CMA_THREADS='lots'"):
        cma.threads_for(1 << 30)


def test_a_failing_share_fails_the_read_after_every_share_ends(monkeypatch):
    monkeypatch.setenv(cma.THREADS_ENV, "2")
    dests = [torch.zeros(24 << 20, dtype=torch.uint8) for _ in range(2)]
    good = torch.ones(24 << 20, dtype=torch.uint8)
    lengths = np.array([24 << 20, 24 << 20], dtype=np.int64)
    ranges = Ranges.of_whole(
        ByteViews(np.array([d.data_ptr() for d in dests]), lengths, dests.__getitem__)
    )
    unmapped = 16 << 40  # no mapping there: the kernel answers EFAULT
    spans = cma._Spans(*ranges.runs(np.array([good.data_ptr(), unmapped], dtype=np.int64)))
    with pytest.raises(TransferError, match="Bad address"):
        cma.read_remote(os.getpid(), spans, _own_link())
    assert torch.equal(dests[0], good)  # the good share was read whole


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
    assert describe_targets({"a": torch.empty(4, 2).t()}) is None
    assert describe_targets({"a": None}) is None
    assert describe_targets({"a": torch.empty(2, dtype=torch.complex64).conj()}) is None
    assert describe_targets({"a": torch.nested.nested_tensor([torch.empty(2)])}) is None
    assert describe_targets({"a": torch.empty(2, 2).to_sparse_csr()}) is None
    # dict(model.named_parameters()): described, and the parameters themselves land
    params = {k: torch.nn.Parameter(torch.empty_like(t)) for k, t in state.items()}
    described = describe_targets(params)
    assert described is not None
    found = match(payload, params, described)
    assert all(found[i] is params[k] for i, k in enumerate(state))


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


def test_a_few_whole_tensors_are_read_in_one_call():
    """A medium transfer (up to 64 tensors, 16 MiB, whole) skips the span planning
    (70 us here, more than reading 1 MiB): one process_vm_readv from the tensors'
    addresses. Anything else, or a read that comes up short, is the general path's."""
    g = torch.Generator().manual_seed(8)
    sources = [torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g) for n in (1 << 20, 0, 7)]
    addresses = np.array([t.data_ptr() for t in sources], dtype=np.int64)
    dests = [torch.zeros_like(t) for t in sources]
    assert cma._read_few(os.getpid(), addresses, Ranges.of_whole(dests), _own_link())
    assert all(torch.equal(d, s) for d, s in zip(dests, sources, strict=True))
    beyond = [torch.ones(4, dtype=torch.uint8) for _ in range(cma._FEW_TENSORS + 1)]
    many = np.array([t.data_ptr() for t in beyond], dtype=np.int64)
    assert not cma._read_few(os.getpid(), many, Ranges.of_whole(beyond), _own_link())
    big = torch.zeros(17 << 20, dtype=torch.uint8)
    one = np.array([big.data_ptr()], dtype=np.int64)
    assert not cma._read_few(os.getpid(), one, Ranges.of_whole([big]), _own_link())
    unmapped = np.array([8], dtype=np.int64)  # cut short: the general path says why
    assert not cma._read_few(os.getpid(), unmapped, Ranges.of_whole(dests[:1]), _own_link())


def test_a_ranged_read_of_a_few_runs_is_read_in_one_call():
    """A short prompt's KV blocks (a run per layer: 16 of 512 KiB at 128 tokens)
    skip the span planning too: one call, each run where its row says. More than
    64 runs, or over 16 MiB, is the general path's."""
    g = torch.Generator().manual_seed(9)
    sources = [torch.randint(0, 255, (1 << 16,), dtype=torch.uint8, generator=g) for _ in range(3)]
    addresses = np.array([t.data_ptr() for t in sources], dtype=np.int64)
    dest = torch.zeros(1 << 16, dtype=torch.uint8)
    base = np.array([dest.data_ptr()], dtype=np.int64)

    def ranges(rows: list[list[int]]) -> Ranges:  # as rd.read_ranges lays its rows out
        return _region_reads._ranges(np.array(rows, dtype=np.int64), [dest], base)

    rows = [[2, 100, 4000, 0, 0], [0, 0, 5, 0, 9000], [1, 60000, 5536, 0, 20000]]
    assert cma._read_few(os.getpid(), addresses, ranges(rows), _own_link())
    for tensor, offset, length, _, at in rows:
        assert torch.equal(dest[at : at + length], sources[tensor][offset : offset + length])
    many = [[0, 8 * i, 4, 0, 8 * i] for i in range(65)]
    assert not cma._read_few(os.getpid(), addresses, ranges(many), _own_link())
