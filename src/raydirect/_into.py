"""Receiving into the caller's own tensors: ``rd.get(ref, into=...)`` and ``rd.set_target``.

``into`` takes two forms. It mirrors the value: a tensor for a value that is
one tensor, or the same structure (dicts matched by key, lists and tuples by
position, objects by their attributes) with tensors where the value has
tensors, for instance ``model.state_dict()`` for a state dict. Or, as Ray's
``set_target_for_ref`` takes it, it is a flat list (or tuple) with one target
per tensor of the value, in the order the value's tensors are met (a dict's
in insertion order; a tensor that appears twice counts once), for instance
``list(model.parameters())``. Every target is checked (type, device, dtype,
shape, contiguity, no byte shared with another target) before a byte moves, and
the bytes land in the targets themselves: no receive buffer, no copy after.
Tensors of the value that ``into`` does not cover arrive in a new buffer as usual.

``device=``, the other way to say where the bytes land, is ``_device_targets``.

A per-ref hint (``rd.set_target``) serves reads this process does not call
itself: Ray rebuilding a task argument, or a plain ``ray.get``. It is keyed by
the object's raydirect id, taken from its Payload, and used once. Hints never
used (their ref dropped unread) are bounded: the oldest are forgotten.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from raydirect._payload import InlinePayload, Payload
from raydirect._ranges import overlapping
from raydirect._split import join, not_dense, state_dict_keys, travels_whole
from raydirect._target_checks import LAZY_VIEW, UNWRITABLE, unwritable
from raydirect._tensors import (
    DTYPE_NAMES,
    TensorMeta,
    TensorMetas,
    device_types,
)

log = logging.getLogger("raydirect")
_HINTS_KEPT = 4096
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_COMPLEX = frozenset(name for dtype, name in DTYPE_NAMES.items() if dtype.is_complex)
_hints: OrderedDict[bytes, Any] = OrderedDict()
_hints_lock = threading.Lock()


class _Slot:
    """Stands where the value has tensor ``index`` while matching ``into``."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class MatchedTargets(dict[int, Any]):
    """Targets by tensor index, as ``match`` found them: ``addresses`` holds each
    target's address in this dict's order, so the read plan asks no tensor again."""

    addresses: np.ndarray


@dataclass(frozen=True, slots=True)
class DescribedTargets:
    """An ``into=`` that is a state dict of contiguous plain tensors in distinct
    memory, described column by column. ``rd.get`` describes it before the value
    arrives, while the producer is still exporting; matching it is then a few
    list comparisons."""

    keys: tuple[str, ...]
    tensors: list[torch.Tensor]
    shapes: list[tuple[int, ...]]  # torch.Size or tuples: equal alike
    dtypes: list[str]
    devices: list[str]
    addresses: list[int]


def describe_targets(into: Any) -> DescribedTargets | None:
    """``into`` described for ``match``, or None where it is not such a state dict
    (``match`` then walks it and names what does not fit)."""
    if not isinstance(into, dict) or not all([type(k) is str for k in into]):
        return None
    return _described(tuple(into), list(into.values()))


def _described(keys: tuple[str, ...], tensors: list[Any]) -> DescribedTargets | None:
    """``tensors`` as columns, or None unless they are contiguous plain torch
    tensors or parameters in distinct memory (``dict(model.named_parameters())``
    of 5,000: 2.7 ms here, 9.4 ms through the checks one by one)."""
    if not all([type(t) in _PLAIN for t in tensors]):
        return None
    columns = _target_columns(tensors)
    if columns is None:
        return None
    shapes, dtypes, devices, addresses = columns
    if len(set(addresses)) != len(addresses):  # empty tensors may share an address
        sizes = [t.nbytes for t in tensors]
        nonempty = [a for a, n in zip(addresses, sizes, strict=True) if n]
        if len(set(nonempty)) != len(nonempty):
            return None  # two targets share memory: the checks name them
    return DescribedTargets(keys, tensors, shapes, dtypes, devices, addresses)


def _target_columns(tensors: list[torch.Tensor]) -> tuple[Any, ...] | None:
    """(shapes, dtypes, devices, addresses) of ``tensors``, one C comprehension
    each, or None when one is not contiguous or is a lazily conjugated or negated
    view. Only a complex tensor can be conjugated: asking the others costs 0.4 ms
    per 5,000 targets."""
    try:
        if not all([t.is_contiguous() for t in tensors]) or any(map(torch.Tensor.is_neg, tensors)):
            return None
        dtypes = [DTYPE_NAMES[t.dtype] for t in tensors]
        if not _COMPLEX.isdisjoint(dtypes) and any([t.is_conj() for t in tensors]):
            return None
        shapes = [t.shape for t in tensors]
    except RuntimeError:  # a sparse CSR or nested tensor (no strides, no one shape)
        return None  # ``_check`` names it
    return (shapes, dtypes, device_types(tensors), [t.data_ptr() for t in tensors])


def _fits(into: DescribedTargets, metas: TensorMetas, order: Sequence[int]) -> bool:
    """Target ``k`` has tensor ``order[k]``'s shape, dtype and device."""
    if isinstance(order, range) and len(order) == len(metas):  # all, in order
        return (
            into.shapes == metas.shapes
            and into.dtypes == metas.dtypes
            and into.devices == metas.devices
        )
    return (
        into.shapes == [metas.shapes[i] for i in order]
        and into.dtypes == [metas.dtypes[i] for i in order]
        and into.devices == [metas.devices[i] for i in order]
    )


def _match_described(
    payload: Payload | InlinePayload, into: DescribedTargets
) -> MatchedTargets | None:
    """``into`` matched by key, when every target fits; None sends the caller
    through the checks one by one (which name what does not fit)."""
    keys = state_dict_keys(payload.skeleton)
    if keys is None:
        return None
    order: Sequence[int]
    if into.keys == keys:  # the same dict as the producer's, in its order
        order = range(len(keys))
    else:
        index = _index(keys)
        if not into.keys or not all([k in index for k in into.keys]):
            return None
        order = [index[k] for k in into.keys]
    if not _fits(into, payload.metas, order):
        return None
    found = MatchedTargets(zip(order, into.tensors, strict=True))
    found.addresses = np.asarray(into.addresses, dtype=np.int64)
    return found


def match(
    payload: Payload | InlinePayload, into: Any, described: DescribedTargets | None = None
) -> MatchedTargets:
    """The target for each of ``payload``'s tensors that ``into`` covers, by index
    (``described``: ``into`` as ``describe_targets`` gave it).

    Raises ``ValueError`` or ``TypeError`` naming the first target that does not fit,
    or two that share memory.
    """
    if described is not None:
        matched = _match_described(payload, described)
        if matched is not None:
            _check_memory(payload.metas, matched)
            return matched
    if isinstance(into, (torch.Tensor, np.ndarray)):
        if len(payload.metas) != 1:
            raise ValueError(
                f"into= is one tensor, but the object holds {len(payload.metas)} tensors; "
                "pass a structure like the value's (a dict, list or tuple of tensors)"
            )
        found = {0: into}
    else:
        found = _match_structure(payload, into)
    matched = MatchedTargets(found)
    matched.addresses = _check_all(payload, found)
    _check_memory(payload.metas, matched)
    return matched


def _check_memory(metas: TensorMetas, matched: MatchedTargets) -> None:
    """No two targets share a byte, and this process can write every one."""
    check_disjoint({0: (metas, matched)})
    bad = unwritable(list(matched.values()))
    if bad is not None:
        raise ValueError(f"{_where(list(matched)[bad])} {UNWRITABLE}")


def check_disjoint(parts: Mapping[int, tuple[TensorMetas, MatchedTargets]]) -> None:
    """Refuse targets that share a byte (views of one buffer that overlap), of one
    object or, for several (``rd.get`` of many refs), across them: each read would
    overwrite the other's bytes, and the value would hold the wrong ones. ``parts``:
    each object's metas and targets, by its ref's position in the call."""
    if sum(len(found) for _, found in parts.values()) < 2:
        return
    sizes, kinds = [], []
    for metas, found in parts.values():
        index = np.fromiter(found, np.int64, len(found))
        sizes.append(np.asarray(metas.nbytes, np.int64)[index])
        kinds.extend(metas.devices if len(index) == len(metas) else metas.select(index).devices)
    starts = np.concatenate([found.addresses for _, found in parts.values()])
    pair = overlapping(starts, np.concatenate(sizes), kinds)
    if pair is None:
        return
    whose = [(r, i) for r, (_, found) in parts.items() for i in found]
    (r1, i1), (r2, i2) = whose[pair[0]], whose[pair[1]]
    where = (
        f"tensors {i1} and {i2} of the object"
        if len(parts) == 1
        else f"tensor {i1} of ref {r1} and tensor {i2} of ref {r2}"
    )
    raise ValueError(
        f"into= targets for {where} overlap in memory: each read would overwrite bytes of "
        "the other; give each tensor a target of its own memory"
    )


def _index(keys: tuple[str, ...]) -> dict[str, int]:
    """Each key's position in a state dict's keys."""
    return dict(zip(keys, range(len(keys)), strict=True))


def _match_structure(payload: Payload | InlinePayload, into: Any) -> dict[int, Any]:
    keys = state_dict_keys(payload.skeleton)
    index = _index(keys) if keys is not None and isinstance(into, Mapping) else None
    if index is not None and into.keys() <= index.keys():
        return {index[k]: t for k, t in into.items() if t is not None}  # a state dict: in bulk
    count = len(payload.metas)
    slots = [_Slot(i) for i in range(count)]
    try:
        shape = join(payload.skeleton, slots, payload.handles)
    except Exception as exc:  # a class whose unpickling insists on real tensors
        raise TypeError(
            f"into= cannot be matched against this value ({type(exc).__name__}: {exc}); "
            "receive without into= and copy"
        ) from exc
    mirrored = not isinstance(into, (list, tuple)) or (
        isinstance(shape, (list, tuple)) and len(shape) == len(into)
    )
    if mirrored:
        found: dict[int, Any] = {}
        _walk(shape, into, "into", found)
        return found
    if len(into) == count and all(t is None or _is_target(t) for t in into):
        return {i: t for i, t in enumerate(into) if t is not None}
    value_form = (
        f"a {type(shape).__name__} of {len(shape)}"
        if isinstance(shape, (list, tuple))
        else f"a {type(shape).__name__}"
    )
    raise TypeError(
        f"into= is a {type(into).__name__} of {len(into)}, which fits neither form: the value "
        f"is {value_form}, so pass the same structure, or a flat list of {count} tensors "
        "(one per tensor of the value, in order)"
    )


def _is_target(obj: Any) -> bool:
    return isinstance(obj, (torch.Tensor, np.ndarray))


def _check_all(payload: Payload | InlinePayload, found: dict[int, Any]) -> np.ndarray:
    """Check each target against its tensor; returns their addresses, in order."""
    described = _described((), list(found.values()))
    if described is not None and _fits(described, payload.metas, list(found)):
        return np.asarray(described.addresses, dtype=np.int64)
    seen: dict[int, str] = {}
    for index, target in found.items():
        _check(target, payload.metas[index], index)
        key = data_address(target)
        if key in seen and payload.metas[index].nbytes:
            raise ValueError(
                f"into= names the same memory for tensors {seen[key]} and {index} of the object; "
                "give each tensor its own target"
            )
        seen[key] = str(index)
    return np.fromiter(map(data_address, found.values()), np.int64, len(found))


def _walk(shape: Any, into: Any, path: str, found: dict[int, Any]) -> None:
    if isinstance(shape, _Slot):
        if into is not None:
            held = found.setdefault(shape.index, into)
            if held is not into and _view_of(held) != _view_of(into):
                raise ValueError(
                    f"{path} and another target are given for one tensor, which the value "
                    "holds twice (tied weights, or one tensor under two names): only one "
                    "would be written. Give the same tensor in both places, or leave one "
                    "out (None) and copy into it after the read"
                )
        return
    if into is None:
        return
    if isinstance(shape, Mapping):
        if not isinstance(into, Mapping):
            raise TypeError(f"{path} is {type(into).__name__}, but the value has a mapping there")
        for key, target in into.items():
            if key not in shape:
                raise ValueError(f"{path}[{key!r}] has no counterpart in the value")
            _walk(shape[key], target, f"{path}[{key!r}]", found)
        return
    if isinstance(shape, (list, tuple)):
        if not isinstance(into, (list, tuple)) or len(into) != len(shape):
            got = (
                f"{type(into).__name__} of {len(into)}"
                if isinstance(into, (list, tuple))
                else (type(into).__name__)
            )
            raise TypeError(f"{path} is {got}, but the value has a sequence of {len(shape)} there")
        for i, (part, target) in enumerate(zip(shape, into, strict=True)):
            _walk(part, target, f"{path}[{i}]", found)
        return
    if isinstance(shape, torch.Tensor):  # it rode in the Payload as itself (``_split``)
        raise TypeError(
            f"{path}: the value's tensor there is {travels_whole(shape)}, which travels "
            "whole (pickled), not into a target; leave it out of into= or put None"
        )
    if hasattr(shape, "__dict__") and type(shape) is type(into):
        for name, part in vars(shape).items():
            _walk(part, getattr(into, name, None), f"{path}.{name}", found)
        return
    raise TypeError(
        f"{path} is {type(into).__name__}, but the value has no tensor there "
        f"({type(shape).__name__}); leave it out of into= or put None"
    )


def _check(target: Any, meta: TensorMeta, index: int) -> None:
    if isinstance(target, np.ndarray):
        if not target.flags.c_contiguous or not target.flags.writeable:
            raise ValueError(f"{_where(index)} must be a writeable C-contiguous numpy array")
        view = torch.from_numpy(target)
    elif isinstance(target, torch.Tensor):
        view = target
        kind = not_dense(target)
        if kind is not None:
            raise ValueError(
                f"{_where(index)} is {kind}; into= writes dense tensors: pass one "
                "(torch.empty(shape, dtype=...)) and convert it after the read (DTensors: "
                "rd.WeightSubscriber writes their local shards)"
            )
        if not target.is_contiguous():
            raise ValueError(
                f"{_where(index)} must be contiguous; pass target.contiguous() and copy back"
            )
    else:
        raise TypeError(
            f"{_where(index)} must be a tensor or numpy array, got {type(target).__name__}"
        )
    dtype = DTYPE_NAMES[view.dtype]
    if view.shape != meta.shape or dtype != meta.dtype:
        raise ValueError(
            f"{_where(index)} has shape {tuple(view.shape)} and dtype {dtype}; the tensor that "
            f"arrives has {_expected(meta)}"
        )
    if view.device.type != meta.device:
        raise ValueError(
            f"{_where(index)} is on {view.device}; the tensor that arrives has {_expected(meta)}"
        )
    if view.is_conj() or view.is_neg():
        raise ValueError(f"{_where(index)} {LAZY_VIEW}")


def _view_of(target: Any) -> tuple[Any, ...]:
    """What makes two targets the same memory seen the same way (two detached
    views of one tied parameter, say): address, shape, dtype, strides in bytes."""
    if isinstance(target, np.ndarray):
        return data_address(target), target.shape, str(target.dtype), target.strides
    if isinstance(target, torch.Tensor):
        size = target.element_size()
        strides = tuple(s * size for s in target.stride())
        return target.data_ptr(), tuple(target.shape), str(target.dtype), strides
    return (id(target),)


def _where(index: int) -> str:
    return f"into= target for tensor {index} of the object"


def _expected(meta: TensorMeta) -> str:
    return f"shape {tuple(meta.shape)}, dtype {meta.dtype}, device {meta.device}"


def data_address(target: Any) -> int:
    """The address of a target's first byte (a tensor or a numpy array)."""
    if isinstance(target, np.ndarray):
        return int(target.__array_interface__["data"][0])
    return int(target.data_ptr())


def writable_bytes(target: Any) -> torch.Tensor:
    """The flat uint8 view of a checked target's memory."""
    view = torch.from_numpy(target) if isinstance(target, np.ndarray) else target.detach()
    return view.reshape(-1).view(torch.uint8)


def copy_into(target: Any, tensor: Any) -> Any:
    """Write ``tensor`` (as received) into ``target``; returns ``target``."""
    src = (
        torch.from_numpy(np.ascontiguousarray(tensor))
        if isinstance(tensor, np.ndarray)
        else (tensor)
    )
    dst = torch.from_numpy(target) if isinstance(target, np.ndarray) else target.detach()
    dst.copy_(src.detach().view(dst.dtype) if src.dtype != dst.dtype else src.detach())
    return target


def set_hint(obj_id: bytes, into: Any) -> None:
    with _hints_lock:
        _hints.pop(obj_id, None)
        if into is not None:
            _hints[obj_id] = into
        if len(_hints) > _HINTS_KEPT:
            _hints.popitem(last=False)
            log.warning(
                "raydirect: more than %d rd.set_target hints were never used; the oldest "
                "is forgotten (read each ref you set a target for, or clear it with None)",
                _HINTS_KEPT,
            )


def take_hint(obj_id: bytes) -> Any:
    with _hints_lock:
        return _hints.pop(obj_id, None)
