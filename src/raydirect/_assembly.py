"""A weight load's reads, assembled from its plan: where each run of bytes lands.

The planner (``_plan``) says which bytes of which rank go where in the target;
this module gives each run a place to land and runs the reads. A run lands
straight in the target where the rank's transport writes into the target's
device (its declared ``devices`` and ``receive_devices``, as ``rd.get(device=)``
decides: ``cuda_ipc`` copies a CUDA trainer's bytes into a host target).
Elsewhere it lands in scratch memory that transport does write, on the published
tensors' device type (page-locked host memory for a CUDA target, so that the
copy over is a DMA that needs no staging of its own), and is copied into the
target once every rank has been read: a CPU trainer read over ``cma`` into a
GPU target. Short runs that land strided in the target go to scratch on the
target's own device too (many small cross-memory reads cost more than the
copy). Every place is per run, so a target whose tensors lie on several devices
loads in one call. CUDA work is synchronised before a load returns.

A pair no read can bring together (a target on ``meta``, or CUDA tensors in a
process that sees no GPU) is refused before a byte moves: ``target_refusal``
and ``published_refusal`` say why and what to do.

The assembled load is kept with the routes it was made for (one per rank: what
its transport writes); a load whose routes differ (a transport fell back) is
assembled anew.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from raydirect import _boxes as boxes
from raydirect import _plan as planner
from raydirect._consumer import fetch_ranges, run_all, writes_into
from raydirect._ranges import ByteViews, Ranges
from raydirect._tensors import allocate_bytes

# Strided runs at least this long land straight in the target; shorter ones go to
# scratch memory and are copied over once (a cross-memory read pays per run).
_DIRECT_RUN = 64 << 10
_PER_RANK = ("ranks", "rank_ptr")  # a Plan's columns that are not one value per row
Writes = frozenset[str] | None  # the device types a rank's read writes into; None: any


# ------------------------------------------------------------ routes


def usable_devices() -> frozenset[str]:
    """The device types this process can hold memory on (and so read into)."""
    return frozenset({"cpu", "cuda"}) if torch.cuda.is_available() else frozenset({"cpu"})


def target_refusal(target: torch.device, usable: frozenset[str]) -> str | None:
    """Why no read can land in a target on ``target`` in this process (what to
    do about it); None when one can."""
    if target.type in usable:
        return None
    if target.type == "meta":
        return (
            "the target is on meta, which holds no memory: materialise it first "
            "(module.to_empty(device=...)) and load into that"
        )
    if target.type == "cuda":
        return (
            "the target is on cuda, but this process sees no CUDA device: give the loading "
            "actor a GPU (num_gpus=...)"
        )
    return f"the target is on {target}: weights load into cpu and cuda memory; move it there"


def published_refusal(published: str, usable: frozenset[str]) -> str | None:
    """Why no transport can read tensors published on ``published`` in this
    process (a byte transport moves a device's memory through this process's
    own device); None when one can."""
    if published in usable:
        return None
    return (
        f"the published tensors are on {published}, and this process sees no "
        f"{published.upper()} device to read them through: give the loading actor a GPU "
        "(num_gpus=...), or publish from host memory"
    )


@dataclass(frozen=True)
class Place:
    """Scratch memory some runs land in before they are copied into the target."""

    device: torch.device
    pinned: bool = False  # page-locked host memory (a copy onto a GPU from it is a DMA)


def place_for(target: torch.device, direct: bool, published: str) -> Place:
    """Where a run lands that cannot land in its target (on ``target``) as it is:
    on the target's own device when the transport writes there (a short strided
    run), else on the published tensors' device type, which it moves; host
    memory bound for a GPU is page-locked."""
    if direct:
        return Place(target)
    return Place(torch.device(published), published == "cpu" and target.type == "cuda")


def direct_rows(
    ranks: np.ndarray, dests: np.ndarray, dest_types: Sequence[str], writes: Sequence[Writes]
) -> np.ndarray:
    """Per row: whether its rank's transport writes into its target's device type
    (``dest_types``: each target's)."""
    kinds = sorted(set(dest_types))
    code = np.fromiter((kinds.index(t) for t in dest_types), np.int64, len(dest_types))
    table = np.array([[w is None or k in w for k in kinds] for w in writes], bool)
    return table.reshape(len(writes), len(kinds))[ranks, code[dests]]


# ------------------------------------------------------------ the load


@dataclass
class Load:
    """A plan ready to run: per rank (its position in the handles), the ranges to
    read; then the copies from scratch into the target, one batch per pair of
    devices, and the CUDA devices to wait for."""

    reads: list[tuple[int, Ranges]]
    copies: list[tuple[list[torch.Tensor], list[torch.Tensor]]]  # (target views, scratch views)
    scratch: list[torch.Tensor]  # kept alive with the views into them
    cuda: list[torch.device] = field(default_factory=list)

    def finish(self) -> None:
        """Copy from scratch into the target; returns once every byte is there."""
        self._settle()  # the reads' own device copies (any thread's stream) are done
        with torch.no_grad():  # one call per pair of devices
            for targets, sources in self.copies:
                torch._foreach_copy_(targets, sources, non_blocking=True)
        self._settle()

    def _settle(self) -> None:
        for device in self.cuda:
            torch.cuda.synchronize(device)


@dataclass
class Planned:
    """A checked plan and the target's flat bytes (``dests``), and the load last
    assembled from them, with the routes it was made for."""

    plan: planner.Plan
    dests: list[torch.Tensor]
    published: str  # the published tensors' device type
    _made: tuple[tuple[Writes, ...], Load] | None = None

    def load_for(self, payloads: Sequence[Any]) -> Load:
        """The load for these ranks' objects, read as this process reads them now."""
        writes = tuple(writes_into(p) for p in payloads)
        if self._made is None or self._made[0] != writes:
            self._made = None  # its scratch goes before the new one is allocated
            self._made = (writes, assembled(self.plan, self.dests, writes, self.published))
        return self._made[1]


def assembled(
    plan: planner.Plan, dests: list[torch.Tensor], writes: Sequence[Writes], published: str
) -> Load:
    """``plan``'s rows as ranges per rank, landing in ``dests`` (flat uint8 views of
    the targets) or in scratch (see the module's docstring); ``writes``: what each
    rank's transport writes into; ``published``: the published device type."""
    rows = {f.name: getattr(plan, f.name) for f in fields(plan) if f.name not in _PER_RANK}
    types = [d.device.type for d in dests]
    direct = direct_rows(rows["rank"], rows["dest"], types, writes)
    split = _strided(rows) & (rows["length"] >= _DIRECT_RUN) & direct
    if split.any():  # long strided runs: one row each, straight into the target
        rows = _split_rows(rows, split)
        direct = direct_rows(rows["rank"], rows["dest"], types, writes)
    place, places = _places(rows["dest"], dests, direct & _strided(rows), ~direct, published)
    nbytes = rows["length"] * rows["count"]
    at, scratch = _scratch(place, places, nbytes)
    pointers = np.fromiter((d.data_ptr() for d in dests), np.int64, len(dests))
    bases = np.fromiter((s.data_ptr() for s in scratch), np.int64, len(scratch))
    addresses = np.where(
        place >= 0,
        np.append(bases, 0)[place] + at,
        pointers[rows["dest"]] + rows["dest_offset"],
    )

    def view(i: int) -> torch.Tensor:
        p = int(place[i])
        if p >= 0:
            return scratch[p][int(at[i]) : int(at[i] + nbytes[i])]
        start = int(rows["dest_offset"][i])
        return dests[rows["dest"][i]][start : start + int(nbytes[i])]

    landing = _landing_types(place, places, rows["dest"], types)
    reads = _reads(rows, addresses, nbytes, view, landing)
    copies = _copies(rows, place, at, dests, scratch)
    touched = [*(d.device for d in dests), *(s.device for s in scratch)]
    return Load(reads, copies, scratch, sorted({d for d in touched if d.type == "cuda"}, key=str))


def _reads(
    rows: dict[str, np.ndarray],
    addresses: np.ndarray,
    nbytes: np.ndarray,
    view: Callable[[int], torch.Tensor],
    types: np.ndarray,
) -> list[tuple[int, Ranges]]:
    """The rows as one ``Ranges`` per rank (rows come grouped by rank): row ``i``
    lands at ``addresses[i]`` (``view(i)``, made when a transport needs it), in
    memory of device type ``types[i]``."""
    reads = []
    bounds = np.flatnonzero(boxes.run_flags(rows["rank"]))
    for first, stop in zip(bounds.tolist(), [*bounds[1:].tolist(), len(nbytes)], strict=True):
        picked = slice(first, stop)
        views = functools.partial(_shifted, view, first)
        ranges = Ranges(
            rows["index"][picked],
            rows["src_offset"][picked],
            rows["length"][picked],
            rows["count"][picked],
            rows["src_stride"][picked],
            ByteViews(addresses[picked], nbytes[picked], views),
            devices=frozenset(types[picked].tolist()),
        )
        reads.append((int(rows["rank"][first]), ranges))
    return reads


def _strided(rows: dict[str, np.ndarray]) -> np.ndarray:
    """Per row: whether its runs lie apart in the target."""
    return (rows["count"] > 1) & (rows["dest_stride"] != rows["length"])


def _places(
    dest: np.ndarray,
    dests: list[torch.Tensor],
    short: np.ndarray,
    staged: np.ndarray,
    published: str,
) -> tuple[np.ndarray, list[Place]]:
    """Each row's scratch (an index into the places), -1 for the target itself:
    ``short`` rows (short strided runs the transport could write in place) on the
    target's device, ``staged`` rows (the transport cannot write the target's
    device) where ``place_for`` says."""
    devices = sorted({d.device for d in dests}, key=str)
    code = np.fromiter((devices.index(d.device) for d in dests), np.int64, len(dests))
    place = np.full(len(dest), -1, np.int64)
    places: list[Place] = []
    for rows, direct in ((short, True), (staged, False)):
        for c in np.unique(code[dest[rows]]).tolist():
            key = place_for(devices[c], direct, published)
            if key not in places:
                places.append(key)
            place[rows & (code[dest] == c)] = places.index(key)
    return place, places


def _scratch(
    place: np.ndarray, places: list[Place], nbytes: np.ndarray
) -> tuple[np.ndarray, list[torch.Tensor]]:
    """Each row's offset in its scratch (0 for rows that land in the target) and
    the scratch memory of each place, allocated."""
    at = np.zeros(len(place), np.int64)
    scratch = []
    for p, key in enumerate(places):
        sizes = np.where(place == p, nbytes, 0)
        at += np.where(place == p, np.cumsum(sizes) - sizes, 0)
        scratch.append(_allocate(int(sizes.sum()), key))
    return at, scratch


def _allocate(nbytes: int, place: Place) -> torch.Tensor:
    if place.pinned:
        try:  # cudaHostAlloc: made once for a plan that is kept, so its cost is paid once
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:  # page-locking refused (a memlock limit): plain memory copies too
            pass
    return allocate_bytes(nbytes, str(place.device))


def _landing_types(
    place: np.ndarray, places: list[Place], dest: np.ndarray, types: list[str]
) -> np.ndarray:
    """Each row's landing device type (its scratch's, else its target's)."""
    names = np.array([*(p.device.type for p in places), *types], dtype=object)
    return names[np.where(place >= 0, place, len(places) + dest)]


def _copies(
    rows: dict[str, np.ndarray],
    place: np.ndarray,
    at: np.ndarray,
    dests: list[torch.Tensor],
    scratch: list[torch.Tensor],
) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """The copies from scratch into the target, batched by pair of devices."""
    batches: dict[tuple[torch.device, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for i in np.flatnonzero(place >= 0).tolist():
        flat, count, length = dests[rows["dest"][i]], int(rows["count"][i]), int(rows["length"][i])
        offset = flat.storage_offset() + int(rows["dest_offset"][i])
        target = flat.as_strided((count, length), (int(rows["dest_stride"][i]), 1), offset)
        p, start = int(place[i]), int(at[i])
        batch = batches.setdefault((flat.device, p), ([], []))
        batch[0].append(target)
        batch[1].append(scratch[p][start : start + count * length].view(count, length))
    return list(batches.values())


def _shifted(view: Callable[[int], torch.Tensor], first: int, i: int) -> torch.Tensor:
    return view(first + i)


def _split_rows(rows: dict[str, np.ndarray], split: np.ndarray) -> dict[str, np.ndarray]:
    """``rows`` with each row marked in ``split`` turned into ``count`` single runs."""
    times = np.where(split, rows["count"], 1)
    row = np.repeat(np.arange(len(times)), times)
    k = np.arange(len(row)) - np.repeat(np.cumsum(times) - times, times)
    out = {name: column[row] for name, column in rows.items()}
    was = split[row]
    out["src_offset"] = out["src_offset"] + np.where(was, k * out["src_stride"], 0)
    out["dest_offset"] = out["dest_offset"] + np.where(was, k * out["dest_stride"], 0)
    out["count"] = np.where(was, 1, out["count"])
    out["src_stride"] = np.where(was, out["length"], out["src_stride"])
    out["dest_stride"] = np.where(was, out["length"], out["dest_stride"])
    return out


def read_all(load: Load, payloads: list[Any], deadline: float | None) -> None:
    """Every rank's ranges at once; the first failure stops the others."""
    if len(load.reads) == 1:  # on this thread: it has ended when this returns
        [(rank, ranges)] = load.reads
        fetch_ranges(payloads[rank], ranges, deadline)
        return
    jobs = {
        rank: functools.partial(fetch_ranges, payloads[rank], ranges, deadline, None)
        for rank, ranges in load.reads
    }
    outcome = run_all(jobs, deadline)
    if outcome.error is not None:
        raise outcome.error
    if outcome.late:
        raise TimeoutError(f"ranks {outcome.late} had not sent their shards by the deadline")
