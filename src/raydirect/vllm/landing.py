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
  parameter that no published tensor fills;
* the layers whose loaders are pure slices and concatenations of published
  tensors (tensor-parallel slices, fused qkv and gate_up, embeddings, norms), with
  where each published box lands in each parameter: those layers take the bytes
  straight into the tensors vLLM then processes, with no loader copy
  (``staging.Receiver``, ``worker``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from vllm.model_executor.layers.attention import is_deferred_attention_layer
from vllm.model_executor.model_loader.reload.layerwise import (
    _get_original_loader,
    get_layerwise_info,
)
from vllm.model_executor.model_loader.reload.meta import (
    SKIP_LOAD_TENSORS,
    SKIP_MODULES,
    restore_layer_on_meta,
)
from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (start, shape)
_FILLS = {torch.Tensor.fill_, torch.Tensor.zero_}
# Quantization methods whose processing reads a layer's loaded tensors and
# replaces them (on CPU: repacks a linear weight), never writing them in place:
# their inputs can be kept and refilled by the next update. Any other method, a
# layer whose loader computes (a transpose, a scale, a padding fill) and vLLM's
# deferred attention layers go through ``load_weights``.
_PLAIN_METHODS = {"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"}


@dataclass(frozen=True)
class Landing:
    """Published tensor ``name``'s box ``src`` lands in box ``dst`` of the
    tensor ``param`` of layer ``layer`` (its qualified name), as is."""

    layer: str
    param: str
    name: str
    src: Box
    dst: Box


@dataclass
class Survey:
    """``reads[name]``: the box of published tensor ``name`` this worker needs
    (its whole shape when unsliced); names absent from it are not used here.
    ``problems``: what the loaders refused, one line each. ``lands``: the
    published tensors landed straight into layers, by name; ``layers``: those
    layers' tensors to fill, (shape, dtype) by layer and tensor name."""

    reads: dict[str, Box] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    lands: dict[str, Landing] = field(default_factory=dict)
    # layers tied to another's tensor that no loader fills: vLLM's reload leaves
    # what their processing made of the old values (on CPU a repacked head)
    retie: list[str] = field(default_factory=list)
    layers: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]] = field(default_factory=dict)


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
        # param storage id -> (published name, its box, the param's box) per copy
        self.copies: dict[int, list[tuple[str, Box | None, Box | None]]] = defaultdict(list)
        self.computed: set[int] = set()  # params written other than by a plain copy
        self.derived = False  # the current load copied in a value it computed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.copy_:
            self._copied(args[0], args[1])
        elif func in _FILLS:
            self._wrote(args[0], filled=True)
        return out

    def _copied(self, dst: torch.Tensor, src: Any) -> None:
        key = _storage(dst)
        if key not in self.params or not isinstance(src, torch.Tensor):
            return
        self._wrote(dst)
        probe = self.probes.get(_storage(src))
        if probe is None:  # a value the loader made, from what it was given
            self.computed.add(key)
            self.derived = True
            return
        name, shape = probe
        if src.dtype != dst.dtype:
            self.problems.append(
                f"{name!r}: published as {str(src.dtype).removeprefix('torch.')}, the engine's "
                f"parameter {self.params[key][0]!r} is {str(dst.dtype).removeprefix('torch.')}"
            )
        box = box_of(src, shape)
        stand = self.params[key][1]
        to = box_of(dst, tuple(stand.shape)) if stand.is_contiguous() else None
        self.copies[key].append((name, box, to if dst.is_contiguous() else None))
        seen = self.reads.get(name, box)
        self.reads[name] = None if box is None or seen is None else _union(seen, box)

    def _wrote(self, dst: torch.Tensor, filled: bool = False) -> None:
        key = _storage(dst)
        if key in self.params:
            self.filled[key] = self.filled.get(key, 0) + dst.numel()
            if filled and dst.numel():  # a fill: a value no published tensor holds
                self.computed.add(key)


def _storage(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


@contextmanager
def _on_meta(model: torch.nn.Module) -> Iterator[tuple[dict[int, Any], dict[int, set[int]]]]:
    """Every layer of ``model`` in checkpoint format on the meta device, put back
    on exit; yields storage id -> (parameter name, stand-in), and for the stand-ins
    of a tensor that several layers share (tied embeddings: one loader fills it,
    the other layer's is skipped), storage id -> the ids of all its stand-ins.

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
    shared: dict[int, set[int]] = defaultdict(set)  # id of a live tensor -> its stand-ins
    try:
        for module in model.modules():
            live = {n: id(t) for n, t in get_layer_tensors(module).items()}
            restore_layer_on_meta(module, get_layerwise_info(module))
            # An earlier reload left vLLM's deferring wrapper on the stand-ins'
            # loaders (it buffers instead of copying): the loader under it copies.
            for n, t in get_layer_tensors(module).items():
                if hasattr(t, "weight_loader"):
                    t.weight_loader = _get_original_loader(t)
                if t.is_meta and n in live:
                    shared[live[n]].add(_storage(t))
        stands = {_storage(p): (name, p) for name, p in model.named_parameters() if p.is_meta}
        yield stands, {key: keys for keys in shared.values() if len(keys) > 1 for key in keys}
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
    with _on_meta(model) as (params, twins), torch.no_grad():
        probes: dict[int, tuple[str, tuple[int, ...]]] = {}
        alive = []  # a freed probe's storage id could come back as a value a loader made
        recorder = _Recorder(probes, params)
        for name, dtype, shape in published:
            probe = torch.empty(shape, dtype=dtype, device="meta")
            alive.append(probe)
            probes[_storage(probe)] = (name, shape)
            try:
                with recorder:
                    model.load_weights([(name, probe)])  # type: ignore[operator]
            except Exception as exc:  # the loader's refusal, whatever its kind
                out.problems.append(f"{name!r}: the engine's loader refused it ({exc!r})")
            if recorder.derived:  # which part it computed from is unknown: all of it
                recorder.reads[name] = None
                recorder.derived = False
        out.problems += recorder.problems
        for key, (pname, stand) in params.items():
            if max(recorder.filled.get(k, 0) for k in twins.get(key, {key})) < stand.numel():
                out.problems.append(
                    f"the engine's parameter {pname!r} is filled by no published tensor"
                )
        out.retie = sorted(
            {params[k][0].rpartition(".")[0] for k in twins if not recorder.filled.get(k)}
        )
        if not out.problems:
            shapes = {n: shape for n, _d, shape in published}
            _plan_landings(model, recorder, shapes, set(twins), out)
    for name, _dtype, shape in published:
        if name in recorder.reads:
            box = recorder.reads[name]
            out.reads[name] = ((0,) * len(shape), shape) if box is None else box
            out.problems += _unread(name, shape, out.reads[name], tp) if tp[1] > 1 else []
    return out


def _plan_landings(
    model: torch.nn.Module,
    recorder: _Recorder,
    shapes: dict[str, tuple[int, ...]],
    tied: set[int],
    out: Survey,
) -> None:
    """Fills ``out.lands`` and ``out.layers`` with the layers all of whose
    tensors are tiled, exactly, by plain copies of published boxes that land
    nowhere else, none of them tied to another layer's; run with the stand-ins
    in place."""
    uses: dict[str, int] = defaultdict(int)
    for copies in recorder.copies.values():
        for name, _src, _dst in copies:
            uses[name] += 1
    for lname, layer in model.named_modules():
        tensors = {n: t for n, t in get_layer_tensors(layer).items() if n not in SKIP_LOAD_TENSORS}
        method = getattr(layer, "quant_method", None)
        if (
            not tensors
            # landed memory is host memory: on GPU the loaders copy to the device
            or get_layerwise_info(layer).restore_device.type != "cpu"
            or layer.__class__.__name__ in SKIP_MODULES
            or is_deferred_attention_layer(layer)
            or (method is not None and type(method).__name__ not in _PLAIN_METHODS)
            or any(_storage(t) in tied for t in tensors.values() if t.is_meta)
        ):
            continue
        lands = [_tiling(lname, n, t, recorder, uses, shapes) for n, t in tensors.items()]
        if all(tiles is not None for tiles in lands):
            out.layers[lname] = {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}
            out.lands.update((land.name, land) for tiles in lands for land in tiles or ())


def _tiling(
    lname: str,
    pname: str,
    stand: torch.Tensor,
    recorder: _Recorder,
    uses: dict[str, int],
    shapes: dict[str, tuple[int, ...]],
) -> list[Landing] | None:
    """The copies that fill ``stand`` exactly once each element, or None."""
    key = _storage(stand) if stand.is_meta else None
    if key is None or key in recorder.computed or key not in recorder.copies:
        return None
    tiles = []
    for name, src, dst in recorder.copies[key]:
        if src is None or dst is None or uses[name] != 1 or len(cut_dims(src, shapes[name])) > 1:
            return None
        tiles.append(Landing(lname, pname, name, src, dst))
    if sum(math.prod(t.dst[1]) for t in tiles) != stand.numel():
        return None
    if any(_overlap(a.dst, b.dst) for i, a in enumerate(tiles) for b in tiles[i + 1 :]):
        return None
    return tiles


def cut_dims(box: Box, shape: tuple[int, ...]) -> list[int]:
    """The dims along which ``box`` is less than the whole of ``shape``."""
    return [d for d, (s, n, f) in enumerate(zip(*box, shape, strict=True)) if (s, n) != (0, f)]


def _overlap(a: Box, b: Box) -> bool:
    return all(x < y + n and y < x + m for x, m, y, n in zip(a[0], a[1], b[0], b[1], strict=True))


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


def unread_problems(shapes: dict[str, tuple[int, ...]], reads: list[dict[str, Box]]) -> list[str]:
    """Placeholder until the survey rewrite lands: the union of every rank's boxes
    must cover each published tensor read at all."""
    out = []
    for name, shape in shapes.items():
        boxes = [r[name] for r in reads if name in r]
        if not boxes:
            continue
        lo = [min(b[0][d] for b in boxes) for d in range(len(shape))]
        hi = [max(b[0][d] + b[1][d] for b in boxes) for d in range(len(shape))]
        for d, (s, e) in enumerate(zip(lo, hi, strict=True)):
            if (s, e) != (0, shape[d]):
                out.append(
                    f"{name!r}: published with shape {shape}, of which the engine's model "
                    f"reads only [{s}, {e}) of dim {d}: not the shape it has"
                )
                break
    return out
