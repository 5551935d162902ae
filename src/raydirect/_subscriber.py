"""Weight sync, the loading side: versions received into the target's own tensors.

``WeightSubscriber.load`` checks a handle against the target before a byte
moves (version, names, shapes, dtypes, devices), then reads straight into the
target's tensors: no new tensors, parameters keep their identity, so an engine
holding them sees the update. With ``shard``, each target tensor is a slice of
the published one and only that slice's bytes are read (``Ranges``): rows of a
row-major tensor are one run of bytes, columns are many runs, one per row.
A tensor the publisher laid out in blocks (``shard_blocks``) is read as the
one block a shard is, in one run, or as whole blocks of rows straight into the
target; otherwise (blocks of columns read whole, a slice that is not whole
blocks) its blocks land in scratch memory and are rearranged into the target.
The plan (checks done, ranges built) is cached per layout, so a steady loop
pays for it once.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from raydirect._consumer import fetch_ranges
from raydirect._into import writable_bytes
from raydirect._payload import PendingFetch, check_usable_here, get_deferred
from raydirect._ranges import Ranges
from raydirect._tensors import torch_dtype
from raydirect._weights import WeightsHandle, WeightsLayout, blocked_view, state_of
from raydirect.errors import RaydirectError, WeightSyncError

Shard = Callable[[str, tuple[int, ...]], "tuple[int, int, int] | None"]
_SHOWN = 5  # problems listed in one error


Row = tuple[int, int, int, int, int]


# After the read, for a blocked tensor read into scratch: a (target, source) pair
# of views to copy, or a function that does what a view cannot.
After = tuple[torch.Tensor, torch.Tensor] | Callable[[], None]


@dataclass
class _Plan:
    ranges: Ranges
    names: list[str]  # loaded, in the order of the ranges' rows
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    after: list[Callable[[], None]] = field(default_factory=list)

    def rearrange(self) -> None:
        """Blocked tensors read into scratch, into their targets: one call for the copies."""
        with torch.no_grad():
            if self.copies:
                torch._foreach_copy_([t for t, _ in self.copies], [s for _, s in self.copies])
            for finish in self.after:
                finish()


class _Targets:
    """The target's tensors by name, and a cheap way to tell, before each load,
    that they are still the tensors (and the memory) the plans were made for.

    An engine may replace a weight's storage between loads: ``param.data = ...``,
    ``.to()`` or ``.half()``, ``load_state_dict(assign=True)``, an offload and
    reload. A plan made before would write memory the model no longer uses and
    report a version the model does not hold (rollouts on a stale policy, with
    nothing said). So each load first compares where each tensor sits (its
    module's parameter or buffer, or the dict's entry) and its data pointer with
    what the plans saw, about 1 ms for 5,000 tensors; on any difference the
    target is read again and the plans made anew, checked before a byte moves.
    """

    def __init__(self, source: Any) -> None:
        self._source = source
        self.read()

    def read(self) -> None:
        self.tensors = state_of(self._source, "target")
        self._held = list(self.tensors.values())
        self._places = _places(self._source, self.tensors)
        self._pointers = [t.data_ptr() for t in self._held]

    def changed(self) -> bool:
        """Read the target again if it changed since it was last read; True if it did."""
        if self._places is not None and self._same():
            return False
        self.read()
        return True

    def _same(self) -> bool:
        assert self._places is not None
        containers, keys, holders = self._places
        if not all([c.get(k) is h for c, k, h in zip(containers, keys, holders, strict=True)]):
            return False  # a parameter, buffer, submodule or dict entry was replaced
        return [t.data_ptr() for t in self._held] == self._pointers


# (containers, keys, what each held): every tensor's and every submodule's place.
_Places = tuple[list[Any], list[str], list[Any]]


def _places(source: Any, tensors: dict[str, torch.Tensor]) -> _Places | None:
    """Where each of ``tensors`` is held in ``source``; None when one cannot be
    found (a state-dict hook made it): the target is then read again every load."""
    if not isinstance(source, torch.nn.Module):
        if len(source) != len(tensors):
            return None
        names = list(tensors)
        return [source] * len(names), names, [tensors[n] for n in names]
    containers: list[Any] = []
    keys: list[str] = []
    holders: list[Any] = []
    found: dict[int, tuple[Any, str]] = {}
    for _, module in source.named_modules(remove_duplicate=False):
        for table in (module._parameters, module._buffers):
            found.update((id(t), (table, n)) for n, t in table.items() if t is not None)
        for name, child in module._modules.items():
            containers.append(module._modules)
            keys.append(name)
            holders.append(child)
    for tensor in tensors.values():
        place = found.get(id(tensor))
        if place is None:
            return None
        containers.append(place[0])
        keys.append(place[1])
        holders.append(tensor)
    return containers, keys, holders


class WeightSubscriber:
    """Loads published versions into ``target`` (an ``nn.Module`` or a dict of
    tensors) in place. ``shard(name, full_shape)`` returns ``None`` (the target
    holds the whole tensor) or ``(dim, start, stop)`` (the slice it holds);
    ``strict`` requires the names to match exactly (else the common ones load).
    """

    def __init__(self, target: Any, *, shard: Shard | None = None, strict: bool = True) -> None:
        self._targets = _Targets(target)
        if shard is not None and not callable(shard):
            raise TypeError(f"shard must be a callable (name, full_shape) -> slice, got {shard!r}")
        self._shard, self._strict = shard, bool(strict)
        self._plans: dict[bytes, _Plan] = {}
        self.version: int | None = None

    def load(self, handle: WeightsHandle | ray.ObjectRef, *, timeout: float | None = None) -> int:
        """Receive ``handle``'s version into the target; returns it (also ``sub.version``).
        ``handle`` may also be a ref to a handle (what an actor's ``publish`` call returns).

        Refused before a byte moves (``WeightSyncError`` naming the tensor) when the
        version is not newer or the handle does not fit the target. A transfer
        that fails midway raises ``WeightSyncError`` (the cause chained): the
        target may then be partly written, and ``sub.version`` stays.
        """
        check_usable_here()
        deadline = None if timeout is None else time.monotonic() + timeout
        if isinstance(handle, ray.ObjectRef):  # a ref to a handle (a method returned it)
            try:
                handle = ray.get(handle, timeout=timeout)
            except (ray.exceptions.RayError, TimeoutError) as exc:
                raise WeightSyncError(
                    f"the handle did not arrive ({type(exc).__name__}: {exc}); nothing was "
                    f"written; sub.version stays {self.version}"
                ) from exc
        if not isinstance(handle, WeightsHandle):
            raise TypeError(f"load takes a WeightsHandle from publish, got {type(handle).__name__}")
        if self.version is not None and handle.version <= self.version:
            raise WeightSyncError(
                f"version {handle.version} is not newer than the loaded one ({self.version}); "
                "nothing was written"
            )
        if self._targets.changed():
            self._plans.clear()  # made for memory the target no longer uses
        plan = self._plan(handle.layout)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            [value] = get_deferred([handle.ref], remaining)
            if not isinstance(value, PendingFetch):
                raise WeightSyncError("the handle's object holds no raydirect tensors")
            fetch_ranges(value.payload, plan.ranges, deadline)
            plan.rearrange()
        except (RaydirectError, ray.exceptions.RayError, TimeoutError) as exc:
            raise WeightSyncError(
                f"loading version {handle.version} failed midway ({type(exc).__name__}: {exc}); "
                f"the target may be partly written; sub.version stays {self.version}"
            ) from exc
        self.version = handle.version
        return handle.version

    def _plan(self, layout: WeightsLayout) -> _Plan:
        plan = self._plans.get(layout.token)
        if plan is None:
            plan = self._make_plan(layout)
            self._plans = {layout.token: plan}  # one layout at a time is what a loop uses
        return plan

    def _make_plan(self, layout: WeightsLayout) -> _Plan:
        problems = self._name_problems(layout)
        rows: list[Row] = []
        dests: list[torch.Tensor] = []
        names: list[str] = []
        plan = _Plan(Ranges.of_rows([], []), names)
        targets = self._targets.tensors
        for i, name in enumerate(layout.names):
            target = targets.get(name)
            if target is None:
                continue
            try:
                spec = self._check(layout, i, target)
            except WeightSyncError as exc:
                problems.append(str(exc))
                continue
            row, dest, after = _read_of(layout, i, target, spec)
            rows.append(row)
            dests.append(dest)
            names.append(name)
            if isinstance(after, tuple):
                plan.copies.append(after)
            elif after is not None:
                plan.after.append(after)
        if problems:
            shown = "; ".join(problems[:_SHOWN])
            more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
            raise WeightSyncError(
                f"the handle does not fit the target: {shown}{more}; nothing was written"
            )
        plan.ranges = Ranges.of_rows(rows, dests)
        return plan

    def _name_problems(self, layout: WeightsLayout) -> list[str]:
        targets = self._targets.tensors
        if not self._strict:
            if not set(layout.names) & set(targets):
                return ["no published name is in the target"]
            return []
        published = set(layout.names)
        problems = [
            f"{n!r} is published but not in the target" for n in layout.names if n not in targets
        ]
        problems += [
            f"{n!r} is in the target but not published" for n in targets if n not in published
        ]
        return problems

    def _check(self, layout: WeightsLayout, i: int, target: torch.Tensor) -> Any:
        """The shard's slice of tensor ``i`` (None: whole), checked against ``target``."""
        name, full, dtype = layout.names[i], layout.shapes[i], layout.dtypes[i]
        spec = self._shard(name, full) if self._shard is not None else None
        shape = full if spec is None else _sliced_shape(name, full, spec)
        got = str(target.dtype).removeprefix("torch.")
        if got != dtype:
            raise WeightSyncError(f"{name!r}: the target is {got}, the published tensor {dtype}")
        if tuple(target.shape) != shape:
            what = "its slice" if spec is not None else "the published tensor"
            raise WeightSyncError(
                f"{name!r}: the target has shape {tuple(target.shape)}, {what} {shape}"
            )
        if target.device.type != layout.device:
            where = f"the published tensor on {layout.device}"
            raise WeightSyncError(f"{name!r}: the target is on {target.device}, {where}")
        if not target.is_contiguous():
            raise WeightSyncError(f"{name!r}: the target is not contiguous")
        return spec


def _read_of(
    layout: WeightsLayout, i: int, target: torch.Tensor, spec: Any
) -> tuple[Row, torch.Tensor, After | None]:
    """How tensor ``i`` is read into ``target``: a row of ranges, where it lands,
    and what to do after (a blocked tensor read into scratch)."""
    full, dtype = layout.shapes[i], layout.dtypes[i]
    element = torch.empty((), dtype=torch_dtype(dtype)).element_size()
    index, base = layout.index[i], layout.offsets[i]
    block = layout.block_of(i)
    if block is None:
        return _slice_row(index, base, full, spec, element), writable_bytes(target), None
    total = math.prod(full) * element
    dim, parts = block
    one, stride, size = total // parts, layout.block_stride(i), full[dim] // parts
    start, stop = (0, full[dim]) if spec is None else (int(spec[1]), int(spec[2]))
    aligned = start % size == 0 and stop % size == 0 and (spec is None or int(spec[0]) == dim)
    if aligned and (stop - start == size or math.prod(full[:dim]) == 1):
        # Whole blocks that are also whole stretches of the target (one block, or
        # blocks of rows): read straight into it, block after block.
        row = (index, base + start // size * stride, one, (stop - start) // size, stride)
        return row, writable_bytes(target), None
    # Every block, back to back into scratch, then into the target in logical order.
    scratch = torch.empty(total, dtype=torch.uint8, device=target.device)
    row = (index, base, total, 1, 0) if stride == one else (index, base, one, parts, stride)
    logical = blocked_view(scratch.view(torch_dtype(dtype)), full, block)
    if spec is None:  # views made once: each load is one copy (with the others)
        return row, scratch, (target.unflatten(dim, (parts, size)), logical)
    return row, scratch, functools.partial(_unblock, logical, target, dim, spec)


def _unblock(logical: torch.Tensor, target: torch.Tensor, dim: int, spec: Any) -> None:
    """Copy a slice of a blocked tensor (``logical``: its blocks read into scratch,
    viewed as ``blocked_source``) into ``target``."""
    sdim, start, stop = (int(v) for v in spec)
    whole = logical.flatten(dim, dim + 1)  # a copy: the blocks are not in order
    target.copy_(whole.narrow(sdim, start, stop - start))


def _sliced_shape(name: str, full: tuple[int, ...], spec: Any) -> tuple[int, ...]:
    try:
        dim, start, stop = (int(v) for v in spec)
    except (TypeError, ValueError):
        raise WeightSyncError(
            f"{name!r}: shard returned {spec!r}; return None or (dim, start, stop)"
        ) from None
    if not (0 <= dim < len(full) and 0 <= start < stop <= full[dim]):
        raise WeightSyncError(
            f"{name!r}: shard slice {(dim, start, stop)} does not fit shape {full}"
        )
    return (*full[:dim], stop - start, *full[dim + 1 :])


def _slice_row(
    index: int, base: int, full: tuple[int, ...], spec: Any, element: int
) -> tuple[int, int, int, int, int]:
    """The (index, offset, length, count, stride) row that reads a slice of a
    row-major tensor starting at byte ``base``: ``count`` runs, ``stride`` apart."""
    total = math.prod(full) * element
    if spec is None:
        return (index, base, total, 1, 0)
    dim, start, stop = (int(v) for v in spec)
    inner = math.prod(full[dim + 1 :]) * element
    outer = math.prod(full[:dim])
    run, stride = (stop - start) * inner, full[dim] * inner
    if outer == 1 or run == stride:  # one contiguous run
        return (index, base + start * inner, run * outer, 1, 0)
    return (index, base + start * inner, run, outer, stride)
