"""What each memo cache saves on a 5,000-tensor step.

The question: raydirect's many-tensor path keeps results between steps (packed
metas, unpacked metas, a state dict's keys, strides, a weight layout's blob,
...). Which of them saves enough of a step to be worth the code? The rule
(issue 24, item 10): keep a cache worth more than about 5% of a 5,000-tensor
step, remove the rest.

Three steps, each between a trainer actor and a reader actor on this node, the
trainer's tensors written in place (untimed) before every step:

- ``into``: ``@rd.method`` returns the state dict; the reader calls
  ``rd.get(ref, into=its own tensors)`` (the primitives path);
- ``new``: the same with ``rd.get(ref)`` (new receive buffers);
- ``weights``: ``WeightPublisher.publish`` in the trainer, the handle passed to
  the reader's ``WeightSubscriber.load`` (the weight API).

A *variant* turns one cache off in both actors: its memo is emptied before
every step (untimed), so the step computes once what the cache keeps between
steps (what code without the cache pays), or, marked "no memo at all", its
function is replaced by its uncached body (losing the reuse inside one step
too). Every round runs every
variant's steps once, in a rotating order (A, B, C, ... then B, C, ..., A), so
that the machine's load falls on all alike; each figure is the median over the
rounds of the difference from the baseline step of the same round, with the
quartiles of those differences.

Measured per step:

- ``calls``: the thread CPU time of the calls each variant changes (its
  *probes*, e.g. ``TensorMetas.pack`` for the packed-metas memo), summed over the
  step. Thread CPU time does not count time spent preempted, so it holds on a
  loaded machine; it is the cache's gain itself;
- ``CPU``: both actors' CPU time (every thread) over the step;
- ``wall``: the step from the driver, the trainer's call until the reader has
  checked the values (first, middle and last tensor, both ends).

Percentages are of the baseline step's CPU time, the most stable figure of a
step's size on a shared machine (the wall time of a step on a quiet one is
smaller: see the table's first lines).

    ./dev python benchmarks/memo_gains.py [--rounds 30] [--tensors 5000] [--only SUBSTRING,...]
        [--against OTHER_CHECKOUT/src]

``--against`` adds the same steps run by a second trainer and reader that import
raydirect from another source tree (``git archive COMMIT src | tar -x -C DIR``,
then ``--against DIR/src``), interleaved with the rest: what every change since
that commit saves or costs, in one run.

A variant whose cache no longer exists in the source is listed as removed (the
script as it was before each removal, with the figures that decided it, is in
git history: ``git log -- benchmarks/memo_gains.py``).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rdbench.common import state_dict_layout  # noqa: E402

import raydirect as rd  # noqa: E402
from raydirect import (  # noqa: E402
    _api,
    _consumer,
    _payload,
    _producer,
    _ranges,
    _subscriber,
    _tensors,
    _weights,
)
from raydirect.transports import cma  # noqa: E402

TOTAL = 256 << 20  # the state's bytes, float32: workload 6's
LAYERS = {200: 22, 5000: 555}  # tensors -> decoder layers (9 tensors each, plus 2)
WARM_ROUNDS = 2  # untimed: layouts, pools, leases, first pages
INTO, NEW, WEIGHTS = "into", "new", "weights"
STEPS = {
    INTO: "@rd.method dict -> rd.get(into=)",
    NEW: "@rd.method dict -> rd.get()",
    WEIGHTS: "publish -> WeightSubscriber.load",
}
TRAINER, READER = "trainer", "reader"
ENV = {"THP_MEM_ALLOC_ENABLE": "1"}  # huge pages for large tensors, as in raydirect bench


def layout(tensors: int) -> dict[str, tuple[int, ...]]:
    if tensors == 1:
        return {"model.embed_tokens.weight": (TOTAL // 4 // 1024, 1024)}
    return state_dict_layout(TOTAL, layers=LAYERS[tensors])


# ------------------------------------------------------------- probes, patches
#
# A probe replaces ``owner.name`` with a function that calls the current target
# and adds its thread CPU time to the actor's tally. Patches change the target
# behind a probe, so a probed call stays measured whatever a variant does to it.

Undo = Callable[[], None]


def _probe(owner: Any, name: str, tally: dict[str, float]) -> None:
    box = {"target": getattr(owner, name)}
    key = f"{getattr(owner, '__name__', owner)}.{name}"

    def probed(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return box["target"](*args, **kwargs)
        finally:
            tally[key] = tally.get(key, 0.0) + time.thread_time() - start

    functools.update_wrapper(probed, box["target"], updated=())
    probed.__probe_box__ = box  # type: ignore[attr-defined]
    setattr(owner, name, probed)


def _current(owner: Any, name: str) -> Any:
    """``owner.name``, or what the probe there calls."""
    got = getattr(owner, name)
    box = getattr(got, "__probe_box__", None)
    return got if box is None else box["target"]


def _replace(owner: Any, name: str, new: Any) -> Undo:
    got = getattr(owner, name)
    box = getattr(got, "__probe_box__", None)
    if box is None:
        setattr(owner, name, new)
        return functools.partial(setattr, owner, name, got)
    old = box["target"]
    box["target"] = new
    return functools.partial(box.__setitem__, "target", old)


# ----------------------------------------------------------------- the variants


@dataclass(frozen=True)
class Variant:
    """What one variant turns off: the steps it can change, whether the source
    still has it, per role a patch held while it runs (returns its undo) and a
    clear run before every step (untimed), and the calls it changes (probes)."""

    name: str
    steps: tuple[str, ...]
    present: Callable[[], bool]
    patch: dict[str, Callable[[Any], Undo]] | None = None
    clear: dict[str, Callable[[Any], None]] | None = None
    # (role, owner, name), or (role, owner, name, steps): counted in those steps only
    probes: tuple[tuple[Any, ...], ...] = ()
    source: str | None = None  # run by actors importing raydirect from this directory


def _is_lru(owner: Any, name: str) -> Callable[[], bool]:
    return lambda: hasattr(owner, name) and hasattr(_current(owner, name), "cache_clear")


def _uncached(owner: Any, name: str) -> Callable[[Any], Undo]:
    return lambda _actor: _replace(owner, name, _current(owner, name).__wrapped__)


def _clear_lru(owner: Any, name: str) -> Callable[[Any], None]:
    return lambda _actor: _current(owner, name).cache_clear()


def _clear_packed(_actor: Any) -> None:
    _tensors._last_packed = (None, b"")  # type: ignore[attr-defined]


def _clear_skeleton(_actor: Any) -> None:
    _payload._last_skeleton = ([], b"")  # type: ignore[attr-defined]


def _clear_ranges_memo(actor: Any) -> None:
    for plan in actor.sub._plans.values():
        plan.ranges._memo.clear()


def _clear_blob(actor: Any) -> None:
    if actor.pub._layout is not None:
        actor.pub._layout.__dict__.pop("_blob", None)


def _clear_layouts(_actor: Any) -> None:
    _weights._layouts.clear()  # type: ignore[attr-defined]


def _clear_seen(actor: Any) -> None:
    actor.pub._seen = None


PUBLISHER, LAYOUT = _weights.WeightPublisher, _weights.WeightsLayout
BASELINE = Variant("baseline: every cache on", (INTO, NEW, WEIGHTS), lambda: True)
_LAYOUT_PROBE = ((READER, _payload, "_state_dict_layout"),)
_STRIDES_PROBE = ((READER, _consumer, "tensors_from_arena"),)
VARIANTS = [
    Variant(
        "TensorMetas.pack memo (_tensors._last_packed)",
        (INTO, NEW),
        lambda: hasattr(_tensors, "_last_packed"),
        clear={TRAINER: _clear_packed},
        probes=((TRAINER, _tensors.TensorMetas, "pack"),),
    ),
    Variant(
        "_payload._unpacked_metas (lru_cache)",
        (INTO, NEW),
        _is_lru(_payload, "_unpacked_metas"),
        clear={READER: _clear_lru(_payload, "_unpacked_metas")},
        probes=((READER, _payload, "_unpacked_metas"),),
    ),
    Variant(
        "_payload._last_skeleton (state-dict skeleton memo)",
        (INTO, NEW),
        lambda: hasattr(_payload, "_last_skeleton"),
        clear={TRAINER: _clear_skeleton},
        probes=((TRAINER, _payload, "_state_dict_skeleton"),),
    ),
    Variant(
        "_payload._state_dict_layout (lru_cache)",
        (INTO, NEW),
        _is_lru(_payload, "_state_dict_layout"),
        clear={READER: _clear_lru(_payload, "_state_dict_layout")},
        probes=_LAYOUT_PROBE,
    ),
    Variant(
        "_payload._state_dict_layout, no memo at all",
        (INTO, NEW),
        _is_lru(_payload, "_state_dict_layout"),
        patch={READER: _uncached(_payload, "_state_dict_layout")},
        probes=_LAYOUT_PROBE,
    ),
    Variant(
        "_tensors.contiguous_strides (lru_cache)",
        (NEW,),
        _is_lru(_tensors, "contiguous_strides"),
        clear={READER: _clear_lru(_tensors, "contiguous_strides")},
        probes=_STRIDES_PROBE,
    ),
    Variant(
        "_tensors.contiguous_strides, no memo at all",
        (NEW,),
        _is_lru(_tensors, "contiguous_strides"),
        patch={READER: _uncached(_tensors, "contiguous_strides")},
        probes=_STRIDES_PROBE,
    ),
    Variant(
        "state-dict format (_payload._STATE_DICT): the pickler instead",
        (INTO, NEW),
        lambda: hasattr(_payload, "_split_state_dict"),
        patch={TRAINER: lambda _a: _replace(_payload, "_split_state_dict", lambda value: None)},
        probes=(
            (TRAINER, _producer, "split"),
            (READER, _api, "match"),
            (READER, _consumer, "join"),
        ),
    ),
    Variant(
        "into= described before the value arrives (_into.describe_targets)",
        (INTO,),
        lambda: hasattr(_api, "describe_targets"),
        patch={READER: lambda _a: _replace(_api, "describe_targets", lambda into: None)},
        probes=((READER, _api, "match"),),  # after the value arrived: the critical path
    ),
    Variant(
        "Ranges.memo (cma spans per plan)",
        (WEIGHTS,),
        lambda: hasattr(_ranges.Ranges, "memo"),
        clear={READER: _clear_ranges_memo},
        probes=(
            (READER, cma, "_Spans"),
            (READER, cma, "_addresses"),
            (READER, _ranges.Ranges, "runs"),
        ),
    ),
    Variant(
        "WeightsLayout.__reduce__ blob (_blob)",
        (WEIGHTS,),
        lambda: "_blob" in (LAYOUT.__reduce__.__code__.co_consts or ()),
        clear={TRAINER: _clear_blob},
        probes=((TRAINER, LAYOUT, "__reduce__"),),
    ),
    Variant(
        "_weights._layouts (layouts by token)",
        (WEIGHTS,),
        lambda: hasattr(_weights, "_layouts"),
        clear={READER: _clear_layouts},
        probes=((READER, _weights, "_layout_from"),),
    ),
    Variant(
        "WeightPublisher._seen (source compared as torch objects)",
        (WEIGHTS,),
        lambda: "_seen" in PUBLISHER._layout_of.__code__.co_names,
        clear={TRAINER: _clear_seen},
        probes=((TRAINER, PUBLISHER, "_layout_of"),),
    ),
]


def _probe_keys(variant: Variant, step: str) -> list[str]:
    return [
        f"{getattr(probe[1], '__name__', probe[1])}.{probe[2]}"
        for probe in variant.probes
        if len(probe) < 4 or step in probe[3]
    ]


# What --against compares besides CPU: the thread CPU time of raydirect's
# outermost calls in a step, in names both sources have. Ray serializes a
# method's return value after the method (a Payload's and a layout's pickling).
_OUTERMOST = (
    (TRAINER, _api, "export", (INTO, NEW)),  # what @rd.method calls
    (TRAINER, _payload.Payload, "__reduce__", (INTO, NEW)),
    (TRAINER, PUBLISHER, "publish", (WEIGHTS,)),
    (TRAINER, LAYOUT, "__reduce__", (WEIGHTS,)),
    (READER, rd, "get", (INTO, NEW)),
    (READER, _weights, "_layout_from", (WEIGHTS,)),  # the handle, as the task's argument
    (READER, _subscriber.WeightSubscriber, "load", (WEIGHTS,)),
)


# ------------------------------------------------------------------- the actors


class _Role:
    """Installs its role's probes, applies one variant at a time (undoing the
    last one's patch) and runs its clear before each step."""

    role = ""

    def _start(self, variants: list[Variant]) -> None:
        self.variant, self.undo = BASELINE, None
        self.tally: dict[str, float] = {}
        seen = set()
        for variant in variants:
            for role, owner, name, *_ in variant.probes:
                if not hasattr(owner, name):  # another source without this call
                    continue
                if role == self.role and (id(owner), name) not in seen:
                    seen.add((id(owner), name))
                    _probe(owner, name, self.tally)

    def configure(self, variant: Variant) -> None:
        if self.undo is not None:
            self.undo()
        patch = (variant.patch or {}).get(self.role)
        self.undo = patch(self) if patch is not None else None
        self.variant = variant

    def _ready(self) -> float:
        """Untimed, before a step: the variant's clear; the tally and CPU clock start."""
        clear = (self.variant.clear or {}).get(self.role)
        if clear is not None:
            clear(self)
        self.tally.clear()
        return time.process_time()

    def measured(self) -> tuple[float, dict[str, float]]:
        """After a step: this process's CPU time (every thread), the probes' tally."""
        return time.process_time(), dict(self.tally)

    def source(self) -> str:
        """Where this process imported raydirect from."""
        return str(Path(rd.__file__).resolve().parents[1])


@ray.remote(num_cpus=0)
class Trainer(_Role):
    role = TRAINER

    def __init__(self, tensors: int, variants: list[Variant]) -> None:
        self._start(variants)
        self.tensors = {k: torch.ones(s) for k, s in layout(tensors).items()}
        self.pub = rd.WeightPublisher(self.tensors, depth=2)
        self.version = 0

    def step(self, seed: float) -> float:
        """Untimed: every tensor written in place (once no object holds it)."""
        for tensor in self.tensors.values():
            rd.wait_tensor_freed(tensor, timeout=60)
            tensor.fill_(seed)
        return self._ready()

    @rd.method
    def state(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    def publish(self) -> Any:
        self.version += 1
        return self.pub.publish(self.version, timeout=60)


@ray.remote(num_cpus=0)
class Reader(_Role):
    role = READER

    def __init__(self, tensors: int, variants: list[Variant]) -> None:
        self._start(variants)
        self.targets = {k: torch.zeros(s) for k, s in layout(tensors).items()}
        self.loaded = {k: torch.zeros(s) for k, s in layout(tensors).items()}
        self.sub = rd.WeightSubscriber(self.loaded)

    def prepare(self) -> float:
        return self._ready()

    def into(self, box: list[Any], seed: float) -> None:
        _check(rd.get(box[0], into=self.targets, timeout=60), seed)

    def new(self, box: list[Any], seed: float) -> None:
        _check(rd.get(box[0], timeout=60), seed)

    def weights(self, handle: Any, seed: float) -> None:
        self.sub.load(handle, timeout=60)
        _check(self.loaded, seed)


def _check(value: dict[str, torch.Tensor], seed: float) -> None:
    """The first, a middle and the last tensor hold the step's seed at both ends."""
    tensors = list(value.values())
    for t in (tensors[0], tensors[len(tensors) // 2], tensors[-1]):
        flat = t.reshape(-1)
        if float(flat[0]) != seed or float(flat[-1]) != seed:
            raise ValueError(f"step {seed}: the reader does not hold the trainer's values")


# ------------------------------------------------------------------ the driver


@dataclass
class Step:
    wall: float
    cpu: float
    tally: dict[str, float]


def one_step(trainer: Any, reader: Any, step: str, seed: float) -> Step:
    cpu = sum(ray.get([trainer.step.remote(seed), reader.prepare.remote()]))
    start = time.perf_counter()
    if step == WEIGHTS:
        ray.get(reader.weights.remote(trainer.publish.remote(), seed))
    else:
        ref = trainer.state.remote()
        ray.get(getattr(reader, step).remote([ref], seed))
        del ref
    wall = time.perf_counter() - start
    (t_cpu, t_tally), (r_cpu, r_tally) = ray.get(
        [trainer.measured.remote(), reader.measured.remote()]
    )
    return Step(wall, t_cpu + r_cpu - cpu, {**t_tally, **r_tally})


Times = dict[tuple[str, str], list[Step]]  # (variant, step) -> one per round


def _pair(tensors: int, variants: list[Variant], source: str | None) -> tuple[Any, Any]:
    """A trainer and a reader with ``variants``' probes; with ``source``,
    importing raydirect from there (and with only that source's variant's probes)."""
    if source is None:
        return Trainer.remote(tensors, variants), Reader.remote(tensors, variants)
    path = f"{source}:{Path(__file__).resolve().parent}"
    env = {"runtime_env": {"env_vars": {**ENV, "PYTHONPATH": path}}}
    own = [v for v in variants if v.source == source]
    pair = Trainer.options(**env).remote(tensors, own), Reader.options(**env).remote(tensors, own)
    found = ray.get([actor.source.remote() for actor in pair])
    if any(Path(f) != Path(source).resolve() for f in found):
        raise RuntimeError(f"--against {source}: the actors imported raydirect from {found}")
    return pair


def run(variants: list[Variant], tensors: int, rounds: int) -> Times:
    pairs = {v.source: _pair(tensors, variants, v.source) for v in variants}
    times: Times = {}
    seed = 0.0
    for r in range(WARM_ROUNDS + rounds):
        shift = r % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            trainer, reader = pairs[variant.source]
            applied = BASELINE if variant.source else variant
            ray.get([trainer.configure.remote(applied), reader.configure.remote(applied)])
            for step in variant.steps:
                seed += 1
                took = one_step(trainer, reader, step, seed)
                if r >= WARM_ROUNDS:
                    times.setdefault((variant.name, step), []).append(took)
        done = "warm-up round" if r < WARM_ROUNDS else f"round {r - WARM_ROUNDS + 1}/{rounds}"
        print(f"[memo_gains] {done} done", file=sys.stderr, flush=True)
    for pair in pairs.values():
        for actor in pair:
            ray.kill(actor)
    return times


def _ms(xs: list[float]) -> str:
    """``median (p25-p75)`` in ms."""
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return f"{1e3 * statistics.median(xs):.1f} ({1e3 * q[0]:.1f}-{1e3 * q[2]:.1f})"


def _saved(xs: list[float], base: list[float]) -> tuple[float, str]:
    """The median of the per-round differences from the baseline, and it with its
    quartiles as text, in ms."""
    diffs = [v - b for v, b in zip(xs, base, strict=True)]
    q = statistics.quantiles(diffs, n=4, method="inclusive") if len(diffs) > 1 else [diffs[0]] * 3
    mid = statistics.median(diffs)
    return mid, f"{1e3 * mid:+.2f} ({1e3 * q[0]:+.2f}..{1e3 * q[2]:+.2f})"


def report(variants: list[Variant], times: Times, removed: list[str]) -> None:
    print("\n| step | wall ms: median (p25-p75) | wall p10 | CPU ms of both actors |")
    print("|---|---:|---:|---:|")
    for s in BASELINE.steps:
        steps = times[(BASELINE.name, s)]
        walls = [t.wall for t in steps]
        p10 = statistics.quantiles(walls, n=10)[0] if len(walls) > 1 else walls[0]
        print(
            f"| {s}: {STEPS[s]} | {_ms(walls)} | {1e3 * p10:.1f} | {_ms([t.cpu for t in steps])} |"
        )
    print(
        "\n| variant | step | calls it changes, ms (median): with -> without "
        "| saves: calls, ms (p25..p75) | CPU of both actors, ms (p25..p75) "
        "| wall, ms (p25..p75) | % of the step's CPU (calls / both actors) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for variant in variants[1:]:
        for s in variant.steps:
            keys = _probe_keys(variant, s)
            base, got = times[(BASELINE.name, s)], times[(variant.name, s)]
            calls_b = [sum(t.tally.get(k, 0.0) for k in keys) for t in base]
            calls_v = [sum(t.tally.get(k, 0.0) for k in keys) for t in got]
            step_cpu = statistics.median(t.cpu for t in base)
            c_mid, c_text = _saved(calls_v, calls_b)
            p_mid, p_text = _saved([t.cpu for t in got], [t.cpu for t in base])
            _, w_text = _saved([t.wall for t in got], [t.wall for t in base])
            with_, without = (1e3 * statistics.median(c) for c in (calls_b, calls_v))
            calls = f"{with_:.2f} -> {without:.2f} | {c_text}" if keys else "- | -"
            c_pct = f"{100 * c_mid / step_cpu:+.1f}%" if keys else "-"
            print(
                f"| {variant.name} | {s} | {calls} | {p_text} | {w_text} "
                f"| {c_pct} / {100 * p_mid / step_cpu:+.1f}% |"
            )
    for name in removed:
        print(f"| {name} | | removed from the source | | | | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds after the warm-up")
    parser.add_argument("--tensors", type=int, default=5000, choices=[1, 200, 5000])
    parser.add_argument("--only", default="", help="comma-separated substrings of variant names")
    parser.add_argument(
        "--against",
        metavar="SRC",
        action="append",
        default=[],
        help="add a variant: the same steps by actors importing raydirect from SRC (the "
        "src/ of another checkout): what the changes since then save (negative: cost). "
        "Repeatable; this checkout's own src/ measures what separate processes alone differ by",
    )
    args = parser.parse_args()
    chosen = [BASELINE, *VARIANTS]
    if args.only:
        wanted = [w.strip() for w in args.only.split(",")]
        chosen = [BASELINE, *(v for v in chosen[1:] if any(w in v.name for w in wanted))]
    variants = [v for v in chosen if v.present()]
    removed = [v.name for v in chosen if not v.present()]
    for source in args.against:
        name = f"raydirect from {source}"
        variants.append(
            Variant(name, BASELINE.steps, lambda: True, probes=_OUTERMOST, source=source)
        )
    env = {**ENV, "PYTHONPATH": str(Path(__file__).resolve().parent)}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        times = run(variants, args.tensors, args.rounds)
    finally:
        ray.shutdown()
    print(f"\n{args.tensors} tensors, {TOTAL >> 20} MiB, {args.rounds} rounds")
    report(variants, times, removed)


if __name__ == "__main__":
    main()
