"""The KV connector's layouts (``raydirect.vllm.kv_layout``), with no engine: the
CPU layout that runs here, and the GPU layouts (FlashAttention NHD and HND,
FlashInfer) built as CPU tensors of the same shapes and strides. Rows built from
two layouts, applied with plain copies, move exactly the blocks asked for."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raydirect.vllm.kv_layout import LayerRuns, block_rows, layers_from_dict, layout_of
from raydirect.vllm.kv_params import KVParamsError

BLOCKS, BLOCK, HEADS, HEAD_DIM = 6, 16, 2, 8


def _caches(kind: str, blocks: int = BLOCKS) -> dict[str, torch.Tensor]:
    def one() -> torch.Tensor:
        if kind == "cpu":  # [num_blocks, kv_heads, block, 2*head_dim]
            return torch.randn(blocks, HEADS, BLOCK, 2 * HEAD_DIM)
        if kind == "flash_nhd":  # [2, num_blocks, block, kv_heads, head_dim]
            return torch.randn(2, blocks, BLOCK, HEADS, HEAD_DIM)
        if kind == "flash_hnd":  # the same shape, heads outside tokens in memory
            return torch.randn(2, blocks, HEADS, BLOCK, HEAD_DIM).transpose(2, 3)
        assert kind == "flashinfer"  # [num_blocks, 2, block, kv_heads, head_dim]
        return torch.randn(blocks, 2, BLOCK, HEADS, HEAD_DIM)

    return {f"model.layers.{i}.self_attn.attn": one() for i in range(3)}


def _block(cache: torch.Tensor, kind: str, b: int) -> torch.Tensor:
    return cache[:, b] if kind.startswith("flash_") else cache[b]


def _apply(rows: np.ndarray, source: list[torch.Tensor], dest: list[torch.Tensor]) -> None:
    for tensor, offset, length, into, at in rows.tolist():
        dest[into][at : at + length] = source[tensor][offset : offset + length]


@pytest.mark.parametrize("kind", ["cpu", "flash_nhd", "flash_hnd", "flashinfer"])
def test_rows_move_exactly_the_blocks_asked_for(kind: str) -> None:
    # P and D with other numbers of blocks: FlashAttention's V half moves with them
    ours, theirs = _caches(kind), _caches(kind, blocks=BLOCKS + 3)
    for cache in ours.values():
        cache.zero_()
    mine, remote = layout_of(ours, BLOCKS), layout_of(theirs, BLOCKS + 3)
    runs = 2 if kind.startswith("flash_") else 1
    assert {len(r.offsets) for r in remote.layers.values()} == {runs}
    # the remote layout travels as JSON
    parsed = layers_from_dict(remote.to_dict())
    rows = block_rows(parsed, mine.layers, [7, 2], [0, 4])
    assert len(rows) == 3 * 2 * runs
    _apply(rows, remote.storages, mine.storages)
    for name, cache in ours.items():
        assert torch.equal(_block(cache, kind, 0), _block(theirs[name], kind, 7))
        assert torch.equal(_block(cache, kind, 4), _block(theirs[name], kind, 2))
        for b in (1, 2, 3, 5):
            assert not _block(cache, kind, b).any(), "a block nobody asked for was written"


def test_layers_sharing_one_storage_export_it_once() -> None:
    raw = torch.zeros(2 * BLOCKS * 64)
    caches = {"a": raw[: BLOCKS * 64].view(BLOCKS, 64), "b": raw[BLOCKS * 64 :].view(BLOCKS, 64)}
    layout = layout_of(caches, BLOCKS)
    assert len(layout.storages) == 1
    assert layout.layers["b"] == LayerRuns(0, BLOCKS * 64 * 4, 64 * 4, (0,), 64 * 4)


def test_other_layouts_are_refused_before_anything_moves() -> None:
    cpu, flash = layout_of(_caches("cpu"), BLOCKS), layout_of(_caches("flash_nhd"), BLOCKS)
    with pytest.raises(ValueError, match="runs of"):
        block_rows(flash.layers, cpu.layers, [0], [0])
    fewer = dict(list(cpu.layers.items())[:2])
    with pytest.raises(ValueError, match="other layers"):
        block_rows(fewer, cpu.layers, [0], [0])
    with pytest.raises(ValueError, match="source blocks"):
        block_rows(cpu.layers, cpu.layers, [0, 1], [0])
    with pytest.raises(ValueError, match="no block dimension"):
        layout_of({"x": torch.zeros(3, 4)}, BLOCKS)
    with pytest.raises(ValueError, match=r"layout\['x'\]: 2 elements, not 5"):
        layers_from_dict({"x": [0, 1]})


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ([0, float("inf"), 64, [0], 64], r"\[1\]: inf is not an integer"),  # JSON's 1e999
        ([0, 10**400, 64, [0], 64], r"\[1\]: an integer of 1329 bits"),
        ([0, 0, 64, [0], True], r"\[4\]: True is not an integer"),
        ([0, 0, 64.0, [0], 64], r"\[2\]: 64.0 is not an integer"),
        ([0, 0, 0, [0], 64], r"\[2\]: 0 is not between 1"),
        ([-1, 0, 64, [0], 64], r"\[0\]: -1 is not between 0"),
        ([0, 0, 64, [], 64], r"\[3\]: 0 elements"),
        ([0, 0, 64, [float("nan")], 64], r"\[3\]\[0\]: nan is not an integer"),
        ("01234", r"'x'\]: '01234' is not a list"),
    ],
)
def test_a_hostile_layout_entry_is_refused_naming_its_field(entry: object, field: str) -> None:
    """A prefill engine's layout comes in the request: ``int(inf)`` raised
    OverflowError (no ValueError), which escaped into vLLM's scheduler."""
    with pytest.raises(KVParamsError, match=field) as refused:
        layers_from_dict({"x": entry})
    assert refused.value.field.startswith("layout['x']")
