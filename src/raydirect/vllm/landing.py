"""What a worker needs of each published tensor, learned from vLLM's own loaders.

vLLM's ``model.load_weights`` knows which part of each checkpoint tensor lands
where in this worker (tensor-parallel slices, fused qkv and gate_up), but only by
running. The survey runs it once per published layout on stand-ins: every
parameter swapped for a meta tensor of the same class and attributes, every
checkpoint tensor a meta tensor of its published shape. Nothing is allocated or
written; a ``TorchFunctionMode`` records each ``copy_`` (which box of which
checkpoint tensor went into which parameter) and each fill. From that:

* the box of each checkpoint tensor this worker reads (with tensor parallelism,
  its slice: a worker pulls only that);
* what the loaders refuse, before a byte moves: a name the model does not know, a
  shape its loader rejects, a dtype that differs from the parameter's, a
  parameter that no published tensor fills.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from vllm.model_executor.model_loader.reload.layerwise import (
    _get_original_loader,
    get_layerwise_info,
)
from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta
from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (start, shape)
_FILLS = {torch.Tensor.fill_, torch.Tensor.zero_}


@dataclass
class Survey:
    """``reads[name]``: the box of published tensor ``name`` this worker needs
    (its whole shape when unsliced); names absent from it are not used here.
    ``problems``: what the loaders refused, one line each."""

    reads: dict[str, Box] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def box_of(view: torch.Tensor, shape: tuple[int, ...]) -> Box | None:
    """The box of a contiguous tensor of ``shape`` that ``view`` is, or None when
    it is not one (a transpose, a reshape)."""
    strides = contiguous_strides(shape)
    if view.dim() != len(shape):
        return None
    if any(s != b for s, b, n in zip(view.stride(), strides, view.shape, strict=True) if n > 1):
        return None
    offset, start = view.storage_offset(), []
    for b in strides:
        start.append(offset // b)
        offset %= b
    if any(s + n > f for s, n, f in zip(start, view.shape, shape, strict=True)):
        return None
    return tuple(start), tuple(view.shape)


def _union(a: Box, b: Box) -> Box:
    lo = tuple(min(x, y) for x, y in zip(a[0], b[0], strict=True))
    hi = tuple(max(x + m, y + n) for x, m, y, n in zip(a[0], a[1], b[0], b[1], strict=True))
    return lo, tuple(h - lo_ for h, lo_ in zip(hi, lo, strict=True))


class _Recorder(TorchFunctionMode):
    def __init__(self, probes: dict[int, tuple[str, tuple[int, ...]]], params: dict[int, Any]):
        super().__init__()
        self.probes, self.params = probes, params  # storage id -> what it stands for
        self.current = ""
        self.reads: dict[str, Box | None] = {}
        self.filled: dict[int, int] = {}  # param storage id -> elements written
        self.problems: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.copy_:
            self._copied(args[0], args[1])
        elif func in _FILLS:
            self._wrote(args[0])
        return out

    def _copied(self, dst: torch.Tensor, src: Any) -> None:
        key = _storage(dst)
        if key not in self.params or not isinstance(src, torch.Tensor):
            return
        self._wrote(dst)
        probe = self.probes.get(_storage(src))
        if probe is None:
            return  # a value the loader made itself
        name, shape = probe
        if src.dtype != dst.dtype:
            self.problems.append(
                f"{name!r}: published as {str(src.dtype).removeprefix('torch.')}, the engine's "
                f"parameter {self.params[key][0]!r} is {str(dst.dtype).removeprefix('torch.')}"
            )
        box = box_of(src, shape)
        seen = self.reads.get(name, box)
        self.reads[name] = None if box is None or seen is None else _union(seen, box)

    def _wrote(self, dst: torch.Tensor) -> None:
        key = _storage(dst)
        if key in self.params:
            self.filled[key] = self.filled.get(key, 0) + dst.numel()


def _storage(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


@contextmanager
def _on_meta(model: torch.nn.Module) -> Iterator[dict[int, Any]]:
    """Every layer of ``model`` in checkpoint format on the meta device, put back
    on exit; yields storage id -> (parameter name, stand-in).

    vLLM's loaders write the layout a layer had before its weights were processed
    (on CPU a linear layer's weight is repacked, its parameter then empty and
    without a loader). vLLM records that layout at load for its own reloads
    (``record_metadata_for_reloading``) and ``restore_layer_on_meta`` rebuilds it,
    loaders and all: the stand-ins are that.
    """
    saved = [
        (m, dict(m._parameters), dict(m._buffers), set(m._non_persistent_buffers_set))
        for m in model.modules()
    ]
    try:
        for module in model.modules():
            restore_layer_on_meta(module, get_layerwise_info(module))
            # An earlier reload left vLLM's deferring wrapper on the stand-ins'
            # loaders (it buffers instead of copying): the loader under it copies.
            for t in get_layer_tensors(module).values():
                if hasattr(t, "weight_loader"):
                    t.weight_loader = _get_original_loader(t)
        yield {_storage(p): (name, p) for name, p in model.named_parameters() if p.is_meta}
    finally:
        for module, params, buffers, non_persistent in saved:
            module._parameters.clear()
            module._parameters.update(params)
            module._buffers.clear()
            module._buffers.update(buffers)
            module._non_persistent_buffers_set.clear()
            module._non_persistent_buffers_set.update(non_persistent)


def survey(
    model: torch.nn.Module,
    published: list[tuple[str, torch.dtype, tuple[int, ...]]],
    tp: tuple[int, int] = (0, 1),
) -> Survey:
    """Runs ``model.load_weights`` on stand-ins of ``published`` (name, dtype,
    global shape) and returns what this worker reads of each, and what is refused.
    ``tp``: this worker's tensor-parallel (rank, size)."""
    out = Survey()
    with _on_meta(model) as params, torch.no_grad():
        probes: dict[int, tuple[str, tuple[int, ...]]] = {}
        recorder = _Recorder(probes, params)
        for name, dtype, shape in published:
            probe = torch.empty(shape, dtype=dtype, device="meta")
            probes[_storage(probe)] = (name, shape)
            try:
                with recorder:
                    model.load_weights([(name, probe)])  # type: ignore[operator]
            except Exception as exc:  # the loader's refusal, whatever its kind
                out.problems.append(f"{name!r}: the engine's loader refused it ({exc!r})")
        out.problems += recorder.problems
        for key, (pname, stand) in params.items():
            if recorder.filled.get(key, 0) < stand.numel():
                out.problems.append(
                    f"the engine's parameter {pname!r} is filled by no published tensor"
                )
    for name, _dtype, shape in published:
        if name in recorder.reads:
            box = recorder.reads[name]
            out.reads[name] = ((0,) * len(shape), shape) if box is None else box
            out.problems += _unread(name, shape, out.reads[name], tp)
    return out


def _unread(name: str, shape: tuple[int, ...], box: Box, tp: tuple[int, int]) -> list[str]:
    """A published tensor larger than the engine's: vLLM's loaders cut their slice
    out of whatever they are given, so they would silently drop the rest. The
    first tensor-parallel rank reads from the start of a cut dim, the last to its
    end (padding and replicated heads included)."""
    rank, size = tp
    for d, (start, n) in enumerate(zip(*box, strict=True)):
        if (rank == 0 and start != 0) or (rank == size - 1 and start + n != shape[d]):
            return [
                f"{name!r}: published with shape {shape}, of which the engine's model "
                f"reads only [{start}, {start + n}) of dim {d}: not the shape it has"
            ]
    return []
