"""Weight sync, the loading side: versions received into the target's own tensors.

``WeightSubscriber.load`` takes one handle, or one per rank of a sharded trainer,
all of one version. Before a byte moves it checks them against the target
(version, names, the ranks' agreement on each global shape and dtype, the boxes
the ranks hold, the target's shapes and dtypes, and that its devices can be
reached), then reads straight into the target's tensors: no new tensors,
parameters keep their identity, so an engine holding them sees the update.

Each target tensor is a box of its global tensor (the whole of it, a ``shard``
slice, or a DTensor's local shard); each rank's handle says which boxes that rank
holds (``_layouts``). The planner (``_plan``) intersects the two: only the
intersections move, each from one rank that holds it, replicas spread over their
owners, in runs as long as both layouts allow. Where each run lands is
``_assembly``'s part: in the target where the transport writes its device, else
in scratch memory copied over once (a CPU trainer's bytes bound for a GPU, short
strided runs). The plan is made once per set of layouts and kept, so a steady
loop pays for it once; all ranks are read at once, and a failure stops every
read before ``load`` raises.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
import torch

from raydirect import _boxes as boxes
from raydirect import _plan as planner
from raydirect import _process
from raydirect._assembly import (
    Planned,
    published_refusal,
    read_all,
    target_refusal,
    usable_devices,
)
from raydirect._into import writable_bytes
from raydirect._layouts import (
    Published,
    WeightsHandle,
    WeightsLayout,
    dtensor_box,
    is_dtensor,
    local_of,
    state_of,
)
from raydirect._payload import PendingFetch, check_usable_here, get_deferred
from raydirect._ranges import overlapping
from raydirect._split import not_dense
from raydirect._target_checks import LAZY_VIEW, UNWRITABLE, unwritable
from raydirect._timeouts import checked_timeout
from raydirect.errors import RaydirectError, WeightSyncError

Shard = Callable[[str, tuple[int, ...]], "tuple[int, int, int] | None"]
_SHOWN = 5  # problems listed in one error


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
        self._held = [local_of(t) for t in self.tensors.values()]
        for name, held in zip(self.tensors, self._held, strict=True):
            kind = not_dense(held)
            if kind is not None:  # torch's own error (of data_ptr) names no tensor
                raise WeightSyncError(f"{name!r}: the target is {kind}; loads write dense tensors")
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
    tensors) in place. ``shard(name, global_shape)`` returns ``None`` (the target
    holds the whole tensor) or ``(dim, start, stop)`` (the slice it holds); a
    DTensor target holds the local shard its placements say, with no ``shard``.
    ``strict`` requires the names to match exactly (else the common ones load).
    Target tensors may lie on another device than the published ones, or on
    several (``_assembly`` routes each).
    """

    def __init__(self, target: Any, *, shard: Shard | None = None, strict: bool = True) -> None:
        if not isinstance(strict, bool):  # strict="false" from a config was strict
            raise TypeError(f"strict must be True or False, got {strict!r}")
        self._targets = _Targets(target)
        if shard is not None and not callable(shard):
            raise TypeError(
                f"shard must be a callable (name, global_shape) -> slice, got {shard!r}"
            )
        self._shard, self._strict = shard, strict
        self._plans: dict[tuple[bytes, ...], Planned] = {}
        # Spreads the replicas this worker reads over their owners (see _plan.plan).
        self._worker = int.from_bytes(_process.PROCESS_TOKEN[:4], "little")
        self.version: int | None = None

    def load(self, handles: Any, *, timeout: float | None = None) -> int:
        """Receive a version into the target; returns it (also ``sub.version``).
        ``handles``: a ``WeightsHandle`` (or a ref to one, what an actor's
        ``publish`` call returns), or a list or tuple of them, one per rank of a
        sharded trainer, all of the same version.

        Refused before a byte moves (``WeightSyncError`` naming the tensor, ending
        "nothing was written") when the version is not newer, the ranks' versions
        differ, the handles do not fit the target, or no read reaches a target's
        device in this process (a target on meta; CUDA weights where no GPU is
        seen). A transfer that fails midway
        raises ``WeightSyncError`` (the cause chained): the target may then be
        partly written, and ``sub.version`` stays.
        """
        check_usable_here()
        timeout = checked_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        ranks = self._handles(handles, timeout)
        version = self._version_of(ranks)
        if self._targets.changed():
            self._plans.clear()  # made for memory the target no longer uses
        planned = self._plan_for(ranks)
        payloads = self._payloads(ranks, deadline, version)
        try:
            load = planned.load_for(payloads)  # how each rank is read here, now
        except RaydirectError as exc:
            raise WeightSyncError(
                f"version {version} cannot be read here ({type(exc).__name__}: {exc}); nothing "
                f"was written; sub.version stays {self.version}"
            ) from exc
        try:
            read_all(load, payloads, deadline)
            load.finish()
        except (RaydirectError, ray.exceptions.RayError, TimeoutError) as exc:
            raise WeightSyncError(
                f"loading version {version} failed midway ({type(exc).__name__}: {exc}); "
                f"the target may be partly written; sub.version stays {self.version}"
            ) from exc
        self.version = version
        return version

    def _handles(self, handles: Any, timeout: float | None) -> list[WeightsHandle]:
        """The handles, one per rank, refs to handles resolved."""
        many = isinstance(handles, (list, tuple))
        given = list(handles) if many else [handles]
        if not given:
            raise ValueError("load takes a handle, or a list with one per trainer rank")
        refs = [h for h in given if isinstance(h, ray.ObjectRef)]
        if refs:  # refs to handles (what actors' publish calls return)
            try:
                got = iter(ray.get(refs, timeout=timeout))
            except (ray.exceptions.RayError, TimeoutError) as exc:
                raise WeightSyncError(
                    f"a handle did not arrive ({type(exc).__name__}: {exc}); nothing was "
                    f"written; sub.version stays {self.version}"
                ) from exc
            given = [next(got) if isinstance(h, ray.ObjectRef) else h for h in given]
        for h in given:
            if not isinstance(h, WeightsHandle):
                raise TypeError(f"load takes WeightsHandles from publish, got {type(h).__name__}")
        return given

    def _payloads(
        self, ranks: list[WeightsHandle], deadline: float | None, version: int
    ) -> list[Any]:
        """Each rank's version object, not fetched yet (no byte has moved)."""
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            values = get_deferred([h.ref for h in ranks], remaining)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            raise WeightSyncError(
                f"version {version}'s objects could not be had ({type(exc).__name__}: {exc}): "
                "a rank that published it died, or is unreachable; nothing was written; "
                f"sub.version stays {self.version}"
            ) from exc
        payloads = [v.payload for v in values if isinstance(v, PendingFetch)]
        if len(payloads) != len(values):
            raise WeightSyncError("a handle's object holds no raydirect tensors")
        return payloads

    def _version_of(self, ranks: list[WeightsHandle]) -> int:
        versions = sorted({h.version for h in ranks})
        if len(versions) > 1:
            said = ", ".join(f"rank {r} has {h.version}" for r, h in enumerate(ranks))
            raise WeightSyncError(
                f"the handles are of different versions ({said}): load one version from "
                "every rank at once; nothing was written"
            )
        version = versions[0]
        if self.version is not None and version <= self.version:
            raise WeightSyncError(
                f"version {version} is not newer than the loaded one ({self.version}); "
                "nothing was written"
            )
        return version

    def _plan_for(self, ranks: list[WeightsHandle]) -> Planned:
        key = tuple(h.layout_token for h in ranks)
        planned = self._plans.get(key)
        if planned is None:  # only now are the layouts decoded (see WeightsHandle)
            planned = self._make_plan(tuple(h.layout for h in ranks))
            self._plans = {key: planned}  # one set of layouts at a time is what a loop uses
        return planned

    def _make_plan(self, layouts: tuple[WeightsLayout, ...]) -> Planned:
        published = Published.of(layouts)
        refused = published_refusal(published.device, usable_devices())
        if refused is not None:
            raise WeightSyncError(f"{refused}; nothing was written")
        problems = self._name_problems(published)
        rows, dests, loaded = self._target_rows(published, problems)
        targets = boxes.Targets(*rows)
        found = planner.check(published.index, targets)
        for t in set(rows[0].tolist()) & set(published.problems):
            found.setdefault(t, [])[:0] = published.problems[t]  # disagreements first
        for t, messages in sorted(found.items()):
            problems.extend(f"{published.names[t]!r}: {m}" for m in messages)
        if problems:
            shown = "; ".join(problems[:_SHOWN])
            more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
            raise WeightSyncError(
                f"the handles do not fit the target: {shown}{more}; nothing was written"
            )
        plan = planner.plan(published.index, targets, self._worker)
        return Planned(plan, dests, published.device)

    def _name_problems(self, published: Published) -> list[str]:
        targets = self._targets.tensors
        if not self._strict:
            if not set(published.number) & set(targets):
                return ["no published name is in the target"]
            return []
        problems = [
            f"{n!r} is published but not in the target" for n in published.names if n not in targets
        ]
        problems += [
            f"{n!r} is in the target but not published"
            for n in targets
            if n not in published.number
        ]
        return problems

    def _target_rows(
        self, published: Published, problems: list[str]
    ) -> tuple[tuple[Any, ...], list[torch.Tensor], list[str]]:
        """The target's boxes as ``boxes.Targets`` columns, the flat bytes of each
        destination, and the names loaded; what does not fit goes to ``problems``."""
        ndim = published.index.tensors.global_shape.shape[1]
        tensor, start, shape, dests, loaded = [], [], [], [], []
        usable = usable_devices()
        for name, target in self._targets.tensors.items():
            t = published.number.get(name)
            if t is None:
                continue
            try:
                box = self._box(name, target, published, t, usable)
            except WeightSyncError as exc:
                problems.append(str(exc))
                continue
            tensor.append(t)
            start.append(box[0])
            shape.append(box[1])
            dests.append(writable_bytes(local_of(target)))
            loaded.append(name)
        overlap = _overlap(loaded, dests)
        if overlap is not None:
            problems.append(overlap)
        bad = unwritable(dests)
        if bad is not None:
            problems.append(f"{loaded[bad]!r} {UNWRITABLE}")
        rows = (
            np.asarray(tensor, np.int64),
            boxes.pad(start, ndim, 0),
            boxes.pad(shape, ndim),
            np.arange(len(tensor), dtype=np.int64),
            np.zeros(len(tensor), np.int64),
        )
        return rows, dests, loaded

    def _box(
        self, name: str, target: torch.Tensor, published: Published, t: int, usable: frozenset[str]
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The (start, shape) of the global tensor ``target`` holds, checked against
        it; ``usable``: the device types this process holds memory on."""
        full, dtype = published.global_shapes[t], published.dtypes[t]
        local = local_of(target)
        if is_dtensor(target):
            global_shape, begin = dtensor_box(name, target)
            if global_shape != full:
                raise WeightSyncError(
                    f"{name!r}: the target DTensor's global shape is {global_shape}, the "
                    f"published tensor's {full}"
                )
            box = (begin, tuple(local.shape))
        else:
            spec = self._shard(name, full) if self._shard is not None else None
            box = _sliced(name, full, spec)
        got = str(local.dtype).removeprefix("torch.")
        if got != dtype:
            raise WeightSyncError(f"{name!r}: the target is {got}, the published tensor {dtype}")
        if tuple(local.shape) != box[1]:
            what = "its slice" if box[1] != full else "the published tensor"
            raise WeightSyncError(
                f"{name!r}: the target has shape {tuple(local.shape)}, {what} {box[1]}"
            )
        refused = target_refusal(local.device, usable)
        if refused is not None:
            raise WeightSyncError(f"{name!r}: {refused}")
        if not local.is_contiguous():
            raise WeightSyncError(f"{name!r}: the target is not contiguous")
        if local.is_conj() or local.is_neg():
            raise WeightSyncError(f"{name!r}: the target {LAZY_VIEW}")
        return box


def _overlap(names: list[str], dests: list[torch.Tensor]) -> str | None:
    """Two targets that share memory without being the same (views of a fused
    tensor whose ranges overlap): each load would overwrite bytes of the other.
    One tensor under two names (tied weights) is the same memory twice: fine."""
    spans = {(d.data_ptr(), d.numel(), d.device.type): n for n, d in zip(names, dests, strict=True)}
    keys = list(spans)
    pair = overlapping(
        np.fromiter((k[0] for k in keys), np.int64, len(keys)),
        np.fromiter((k[1] for k in keys), np.int64, len(keys)),
        [k[2] for k in keys],
    )
    if pair is None:
        return None
    first, second = spans[keys[pair[0]]], spans[keys[pair[1]]]
    return (
        f"{first!r} and {second!r}: the targets overlap in memory, and each load would "
        "overwrite bytes of the other; give each its own memory (check the ranges of views "
        "of one fused tensor)"
    )


def _sliced(name: str, full: tuple[int, ...], spec: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The box a ``shard`` result names: the whole tensor for None."""
    if spec is None:
        return (0,) * len(full), full
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
    begin = tuple(start if d == dim else 0 for d in range(len(full)))
    return begin, (*full[:dim], stop - start, *full[dim + 1 :])
