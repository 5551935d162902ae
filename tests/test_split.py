"""Splitting values into a skeleton and tensors, in one process: the bulk paths
(a state dict skips the pickler; metas travel as columns; byte views are made
only when asked for) give what the general path gives."""

from __future__ import annotations

import pickle

import numpy as np
import torch

from raydirect import _split
from raydirect._ranges import ByteViews, Ranges
from raydirect._tensors import TensorMeta, TensorMetas, describe, tensors_from_arena
from raydirect.testing import mismatch


def _state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(8, 4, generator=g),
        "b": torch.randn(4, generator=g).to(torch.bfloat16),
        "steps": torch.tensor(7),
        "empty": torch.empty(0, 3),
        "wt": torch.randn(4, 8, generator=g).t(),  # a view: sends its own elements
    }


def test_a_state_dict_skips_the_pickler_and_joins_back_in_order():
    value = _state_dict()
    parts = _split.split(value)
    assert parts.skeleton.startswith(_split._STATE_DICT)
    assert _split.state_dict_keys(parts.skeleton) == tuple(value)
    back = _split.join(parts.skeleton, parts.tensors, parts.handles)
    assert list(back) == list(value) and mismatch(back, value) is None


def test_values_that_are_not_plain_state_dicts_take_the_general_path():
    t = torch.ones(3)
    for value in (
        {"a": t, "b": t},  # tied: one tensor, sent once
        {1: t},  # not str keys
        {"a": torch.nn.Parameter(t.clone())},
        {"a": t, "n": 1},
        [t],
    ):
        parts = _split.split(value)
        assert not parts.skeleton.startswith(_split._STATE_DICT), value
        back = _split.join(parts.skeleton, parts.tensors, parts.handles)
        assert mismatch(back, value) is None
    parts = _split.split({"a": t, "b": t})
    assert len(parts.tensors) == 1


def test_metas_as_columns_equal_the_per_tensor_description():
    originals: list = [
        *_state_dict().values(),
        torch.ones(2, requires_grad=True),
        torch.nn.Parameter(torch.zeros(3)),
        np.arange(6, dtype=np.int16).reshape(2, 3),
    ]
    parts = _split.split(originals)
    want = [describe(o, t) for o, t in zip(parts.originals, parts.tensors, strict=True)]
    assert list(parts.metas) == want
    unpacked = TensorMetas.unpack(pickle.loads(pickle.dumps(parts.metas.pack())))
    assert list(unpacked) == want
    assert list(unpacked.select([5, 0])) == [want[5], want[0]]
    assert unpacked.total_bytes() == sum(m.nbytes for m in want)
    plain = _split.split(_state_dict()).metas
    assert plain.rest is None  # every tensor plain: the rare columns are not sent


def test_views_made_in_bulk_rebuild_every_tensor():
    originals = [*_state_dict().values(), torch.ones(2, requires_grad=True)]
    metas = TensorMetas.of(
        TensorMeta(tuple(t.shape), str(t.dtype)[6:], t.nbytes, "cpu") for t in originals
    )
    metas.rest = [(0, False, False, None)] * (len(originals) - 1) + [(0, True, False, None)]
    offsets = [0, 128, 256, 320, 320]
    offsets.append(offsets[-1] + 128)
    arena = torch.zeros(offsets[-1] + 64, dtype=torch.uint8)
    for t, off in zip(originals, offsets, strict=True):
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        arena[off : off + flat.numel()] = flat
    got = tensors_from_arena(arena, metas, offsets)
    assert mismatch(got, originals) is None


def test_zero_element_tensors_land_on_the_arenas_device():
    """A zero-element tensor has no bytes in the arena but must still arrive on its
    device (on a GPU: ``torch.empty(0, 5, device="cuda")`` once arrived on the CPU).
    The meta device stands in for CUDA here: no memory, same device logic."""
    metas = TensorMetas.of(
        [TensorMeta((4, 2), "float32", 32, "cuda"), TensorMeta((0, 5), "float32", 0, "cuda")]
    )
    arena = torch.empty(64, dtype=torch.uint8, device="meta")
    got = tensors_from_arena(arena, metas, [0, 64])
    assert [t.device.type for t in got] == ["meta", "meta"]
    assert [tuple(t.shape) for t in got] == [(4, 2), (0, 5)]


def test_byte_views_give_addresses_without_making_views():
    made = []
    data = torch.arange(10, dtype=torch.uint8)

    def view(i: int) -> torch.Tensor:
        made.append(i)
        return data[i * 5 : i * 5 + 5]

    views = ByteViews(np.array([data.data_ptr(), data.data_ptr() + 5]), np.array([5, 5]), view)
    ranges = Ranges.of_whole(views)
    assert ranges.dest_addresses().tolist() == [data.data_ptr(), data.data_ptr() + 5]
    assert made == []  # addresses alone made no view
    assert views[1].tolist() == [5, 6, 7, 8, 9] and views[-1] is views[1] and made == [1]
    assert [v.tolist() for v in views] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
