"""What a worker needs of each published tensor, learned from vLLM's own loaders.

vLLM's ``model.load_weights`` knows which part of each checkpoint tensor lands
where in this worker (tensor-parallel slices, fused qkv and gate_up), but only by
running. The survey runs it once per published layout, on all of it at once, on
stand-ins: every parameter swapped for a meta tensor of the same class and
attributes, every checkpoint tensor a meta tensor of its published shape.
Nothing is allocated or written. A ``TorchDispatchMode`` sees every aten op the
loaders run (``copy_``, item assignment, in-place arithmetic, ``out=``), finds
the tensors each op writes from its schema, and follows through every op which
published tensors each value was computed from. From that:

* the box of each checkpoint tensor this worker reads (with tensor parallelism,
  its slice: a worker pulls only that; a tensor a value is computed from is read
  whole unless the box it was read from is known);
* what the loaders refuse, before a byte moves: a name the model does not know, a
  shape its loader rejects, a parameter that no published tensor fills (and,
  across ranks, ``unread_problems``: a tensor larger than the engine's);
* the layers whose tensors are each written exactly once by plain same-dtype
  copies of published boxes (tensor-parallel slices, fused qkv and gate_up,
  embeddings, norms), with where each box lands in each tensor: those layers
  take the bytes straight into the tensors vLLM then processes, with no loader
  copy (``staging.Receiver``, ``worker``). Any other write (a scale after the
  copy, a cast, a transpose, a fill) leaves the layer to its loaders, and a
  published tensor that anything is computed from is never landed.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from vllm.model_executor.layers.attention import is_deferred_attention_layer
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
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
Published = list[tuple[str, torch.dtype, tuple[int, ...]]]
# Quantization methods whose processing reads a layer's loaded tensors and
# replaces them (on CPU: repacks a linear weight), never writing them in place:
# their inputs can be kept and refilled by the next update. Any other method
# (subclasses included: they may process differently), a layer whose loader
# computes and vLLM's deferred attention layers go through ``load_weights``.
_PLAIN_METHODS: set[type] = {UnquantizedLinearMethod, UnquantizedEmbeddingMethod}
_COPY = torch.ops.aten.copy_.default
_INDEX_PUT = torch.ops.aten.index_put_.default


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
    it is not one (a transpose, a broadcast, a reshape across dims). ``view`` may
    lack the box's dims of size one (``loaded[i]``, item assignment's select)."""
    if view.numel() == 0:
        return None
    strides = contiguous_strides(shape)
    offset, start = view.storage_offset(), []
    for b in strides:
        start.append(offset // b)
        offset %= b
    size, d = [1] * len(shape), 0
    for n, s in zip(view.shape, view.stride(), strict=True):
        if n == 1:
            continue
        # each dim of the view is the next dim of ``shape`` with its stride
        while d < len(shape) and (strides[d] != s or shape[d] == 1):
            d += 1
        if d == len(shape):
            return None
        size[d], d = n, d + 1
    if any(s + n > f for s, n, f in zip(start, size, shape, strict=True)):
        return None
    return tuple(start), tuple(size)


def _union(a: Box, b: Box) -> Box:
    lo = tuple(min(x, y) for x, y in zip(a[0], b[0], strict=True))
    hi = tuple(max(x + m, y + n) for x, m, y, n in zip(a[0], a[1], b[0], b[1], strict=True))
    return lo, tuple(h - lo_ for h, lo_ in zip(hi, lo, strict=True))


def _storage(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors ``func`` writes, from its schema (``Tensor(a!)``: in-place
    ops' ``self``, ``out=``): no list of op names can keep up with aten."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out += _tensors(args[i] if i < len(args) else kwargs.get(arg.name))
    return out


def _index_volume(dst: torch.Tensor, indices: list[torch.Tensor | None]) -> int:
    """The elements ``dst[indices] = ...`` writes (a mask: at most all it covers)."""
    shapes, rest, d = [], 1, 0
    for idx in indices:
        if idx is None:
            rest, d = rest * dst.shape[d], d + 1
        elif idx.dtype == torch.bool:
            shapes.append(torch.Size([idx.numel()]))
            d += idx.dim()
        else:
            shapes.append(idx.shape)
            d += 1
    return math.prod(torch.broadcast_shapes(*shapes)) * rest * math.prod(dst.shape[d:])


class _Recorder(TorchDispatchMode):
    """Every write to a stand-in's storage and, per storage, the published names
    its value was computed from (a view shares its base's storage, so its
    taint). Probes and stand-ins stay alive through the survey: a freed one's
    storage id could come back as a value a loader made."""

    def __init__(self, probes: dict[int, tuple[str, tuple[int, ...]]], params: dict[int, Any]):
        super().__init__()
        self.probes, self.params = probes, params  # storage id -> what it stands for
        self.taint: dict[int, set[str]] = {k: {name} for k, (name, _) in probes.items()}
        self.reads: dict[str, Box | None] = {}  # None: read whole
        self.filled: dict[int, int] = {}  # param storage id -> elements written
        # param storage id -> (published name, its box, the param's box) per plain copy
        self.copies: dict[int, list[tuple[str, Box | None, Box | None]]] = defaultdict(list)
        self.computed: set[int] = set()  # params written other than by a plain copy
        self.fed: set[str] = set()  # published names some computed value came from
        self.dirty: set[int] = set()  # probes a loader wrote into: no longer as published
        self.broadcasts: set[str] = set()  # copies vLLM's reload refuses, one line each

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is _COPY and args[0].numel() != args[1].numel():
            self._broadcast(args[0], args[1])
        if func.is_view or (func is _COPY and self._plain(args[0], args[1])):
            return out
        written = _written(func, args, kwargs)
        # a copy does not read what it overwrites; any other op may
        names = self._read(_tensors(args[1] if func is _COPY else (args, kwargs)))
        for t in written:
            count = _index_volume(t, args[1]) if func is _INDEX_PUT else t.numel()
            self._wrote(t, names, count)
        done = {_storage(t) for t in written}
        for t in _tensors(out):  # a fresh value: what it was computed from, no more
            key = _storage(t)
            if key not in done and key not in self.params and key not in self.probes:
                self.taint[key] = names
        return out

    def _broadcast(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A loader's copy that broadcasts (a vocabulary embedding's loader checks
        one dim only and copies the rest): torch takes it here, on meta tensors,
        but vLLM's reload counts each copy's elements and asserts they match, so
        the load would fail midway, after some layers changed."""
        shapes = dict(self.probes.values())
        for name in sorted(self.taint.get(_storage(src), set())):
            self.broadcasts.add(
                f"{name!r}: published with shape {shapes[name]}, which the engine's loader "
                f"would broadcast into {tuple(dst.shape)}: not the shape it has"
            )

    def _plain(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Records ``dst.copy_(src)`` if it is a same-dtype copy of a published
        tensor, as published, into a parameter; False for any other copy."""
        key, probe = _storage(dst), self.probes.get(_storage(src))
        if key not in self.params or probe is None or src.dtype != dst.dtype:
            return False
        if _storage(src) in self.dirty:
            return False
        name, shape = probe
        box, stand = box_of(src, shape), self.params[key][1]
        to = box_of(dst, tuple(stand.shape)) if stand.is_contiguous() else None
        self.copies[key].append((name, box, to if dst.is_contiguous() else None))
        self._read_box(name, box)
        self.filled[key] = self.filled.get(key, 0) + dst.numel()
        self.taint[key] = self.taint.get(key, set()) | {name}
        return True

    def _read(self, inputs: list[torch.Tensor]) -> set[str]:
        """The published names ``inputs`` were computed from, now all fed into a
        computed value; the boxes of the probes read directly."""
        names: set[str] = set()
        for t in inputs:
            if not t.numel():  # holds no value (a fill's empty slice of padding)
                continue
            key = _storage(t)
            names |= self.taint.get(key, set())
            if key in self.probes:
                name, shape = self.probes[key]
                self._read_box(name, box_of(t, shape))
        self.fed |= names
        return names

    def _read_box(self, name: str, box: Box | None) -> None:
        seen = self.reads.get(name, box)
        self.reads[name] = None if box is None or seen is None else _union(seen, box)

    def _wrote(self, dst: torch.Tensor, names: set[str], count: int) -> None:
        key = _storage(dst)
        if key in self.params:
            self.filled[key] = self.filled.get(key, 0) + count
            if dst.numel():  # an empty write (a fill of no padding) changes nothing
                self.computed.add(key)
        elif key in self.probes:
            self.dirty.add(key)
        self.taint[key] = self.taint.get(key, set()) | names


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


def survey(model: torch.nn.Module, published: Published) -> Survey:
    """Runs ``model.load_weights`` on stand-ins of ``published`` (name, dtype,
    global shape), once for all of them, and returns what this worker reads of
    each, what is refused and what lands directly."""
    out = Survey()
    shapes = {name: tuple(shape) for name, _dtype, shape in published}
    with _on_meta(model) as (params, twins), torch.no_grad():
        probes = [(n, torch.empty(s, dtype=d, device="meta")) for n, d, s in published]
        ids = {_storage(p): (n, shapes[n]) for n, p in probes}
        recorder = _Recorder(ids, params)
        try:
            with recorder:
                model.load_weights(probes)  # type: ignore[operator]
        except Exception as exc:  # the loaders' refusal, whatever its kind
            recorder = _Recorder(ids, params)
            out.problems += _refused(model, probes, recorder) or [
                f"the engine's loader refused the update ({exc!r})"
            ]
        out.problems += sorted(recorder.broadcasts)
        for key, (pname, stand) in params.items():
            if max(recorder.filled.get(k, 0) for k in twins.get(key, {key})) < stand.numel():
                out.problems.append(
                    f"the engine's parameter {pname!r} is filled by no published tensor"
                )
        out.retie = sorted(
            {params[k][0].rpartition(".")[0] for k in twins if not recorder.filled.get(k)}
        )
        if not out.problems:
            _plan_landings(model, recorder, shapes, set(twins), out)
    for name, shape in shapes.items():
        if name in recorder.reads:
            box = recorder.reads[name]
            out.reads[name] = ((0,) * len(shape), shape) if box is None else box
    return out


def _refused(
    model: torch.nn.Module, probes: list[tuple[str, torch.Tensor]], recorder: _Recorder
) -> list[str]:
    """The published tensors the loaders refuse one by one (only once the whole
    layout was refused: a call per tensor costs minutes on a large model)."""
    problems = []
    for name, probe in probes:
        try:
            with recorder:
                model.load_weights([(name, probe)])  # type: ignore[operator]
        except Exception as exc:
            problems.append(f"{name!r}: the engine's loader refused it ({exc!r})")
    return problems


def unread_problems(shapes: dict[str, tuple[int, ...]], reads: list[dict[str, Box]]) -> list[str]:
    """One line per published tensor (global ``shapes``) that the ranks' reads
    (each rank's ``Survey.reads``) do not cover whole, together: a tensor larger
    than the engine's, which vLLM's loaders would silently cut (each rank cuts
    its slice out of whatever it is given). Names no rank reads are not here."""
    problems = []
    for name, shape in shapes.items():
        boxes = [rank[name] for rank in reads if name in rank]
        if not boxes:
            continue
        box = functools.reduce(_union, boxes)
        cut = cut_dims(box, tuple(shape))
        if cut:
            what = ", ".join(f"[{box[0][d]}, {box[0][d] + box[1][d]}) of dim {d}" for d in cut)
            problems.append(
                f"{name!r}: published with shape {tuple(shape)}, of which the engine's "
                f"model reads only {what}: not the shape it has"
            )
    return problems


def _plan_landings(
    model: torch.nn.Module,
    recorder: _Recorder,
    shapes: dict[str, tuple[int, ...]],
    tied: set[int],
    out: Survey,
) -> None:
    """Fills ``out.lands`` and ``out.layers`` with the layers all of whose
    tensors are tiled, exactly, by plain copies of published boxes that land
    nowhere else and feed no computed value, none of them tied to another
    layer's; run with the stand-ins in place."""
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
            or (method is not None and type(method) not in _PLAIN_METHODS)
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
    """The plain copies that fill ``stand`` exactly once each element, each a
    published box received as is into a box of the same shape, or None."""
    key = _storage(stand) if stand.is_meta else None
    if key is None or key in recorder.computed or key not in recorder.copies:
        return None
    tiles = []
    for name, src, dst in recorder.copies[key]:
        if src is None or dst is None or src[1] != dst[1]:
            return None  # a transpose, a broadcast, a reshape: not bytes as published
        if name in recorder.fed or uses[name] != 1 or len(cut_dims(src, shapes[name])) > 1:
            return None  # landed, no loader would see it elsewhere
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
