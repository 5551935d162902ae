"""Where one step of the primitives path spends its time, call by call.

A trainer actor returns its state dict from an ``@rd.method``; a consumer reads it
with ``rd.get(ref, into=its own tensors)``. Between steps the trainer waits until
no object holds its tensors and writes every one in place (untimed). Inside both
actors, wall-clock marks wrap raydirect's own calls (found by name, so this is a
profiling aid that follows the code, not an API); the table gives, for each call,
when it started and ended after the driver's call, and how long it took:
medians over the steps after the first.

    ./dev python benchmarks/step_timeline.py [--tensors 1,200,5000] [--steps 20]
        [--malloc-huge-pages]

``--malloc-huge-pages`` starts both actors with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``
(glibc 2.35+): malloc's own memory, where small tensors live, then gets
transparent huge pages too.

The layouts are workload 6's (``rdbench.common.state_dict_layout``): 256 MiB as one
tensor, as 200 (22 decoder layers) and as 5,000 (555). Huge pages for large
allocations as in ``raydirect bench`` (``THP_MEM_ALLOC_ENABLE=1``).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rdbench.common import state_dict_layout  # noqa: E402

import raydirect as rd  # noqa: E402

TOTAL = 256 << 20
MALLOC_HUGE_PAGES = "glibc.malloc.hugetlb=1"  # read by glibc when a process starts
LAYERS = {200: 22, 5000: 555}
# (module, name) of the calls marked in each role.
PRODUCER_CALLS = [
    ("raydirect._api", "export"),
    ("raydirect._producer", "split"),
    ("raydirect._producer", "_stored"),
    ("raydirect._producer", "_extract_all"),
]
CONSUMER_CALLS = [
    ("raydirect._api", "get_deferred"),
    ("raydirect._api", "match"),
    ("raydirect._consumer", "_slots"),
    ("raydirect.transports.cma", "read_remote"),
    ("raydirect._consumer", "join"),
]


def layout(tensors: int) -> dict[str, tuple[int, ...]]:
    if tensors == 1:
        return {"model.embed_tokens.weight": (TOTAL // 4 // 1024, 1024)}
    return state_dict_layout(TOTAL, layers=LAYERS[tensors])


class _Marks:
    """Wall-clock (start, end) of every marked call in this process."""

    def __init__(self, calls: list[tuple[str, str]]) -> None:
        self.marks: list[tuple[str, float, float]] = []
        for module_name, name in calls:
            module = importlib.import_module(module_name)
            setattr(module, name, self._wrapped(name, getattr(module, name)))

    def _wrapped(self, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def marked(*args: Any, **kwargs: Any) -> Any:
            start = time.time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.marks.append((name, start, time.time()))

        return marked


@ray.remote(num_cpus=0)
class Trainer:
    def __init__(self, tensors: int) -> None:
        self.tensors = {k: torch.ones(s) for k, s in layout(tensors).items()}
        self.recorder = _Marks(PRODUCER_CALLS)

    def step(self, seed: int) -> None:
        for tensor in self.tensors.values():
            rd.wait_tensor_freed(tensor, timeout=60)
            tensor.fill_(seed)
        self.recorder.marks.clear()

    @rd.method
    def state(self) -> dict[str, torch.Tensor]:
        self.recorder.marks.append(("method", time.time(), time.time()))
        return dict(self.tensors)

    def marks(self) -> list[tuple[str, float, float]]:
        return self.recorder.marks


@ray.remote(num_cpus=0)
class Reader:
    def __init__(self, tensors: int) -> None:
        self.targets = {k: torch.zeros(s) for k, s in layout(tensors).items()}
        self.recorder = _Marks(CONSUMER_CALLS)

    def load(self, box: list[Any], seed: int) -> list[tuple[str, float, float]]:
        self.recorder.marks.clear()
        start = time.time()
        rd.get(box[0], into=self.targets, timeout=60)
        self.recorder.marks.append(("rd.get", start, time.time()))
        first = next(iter(self.targets.values()))
        if float(first.reshape(-1)[0]) != seed:
            raise ValueError(f"step {seed}: the targets do not hold the trainer's values")
        return self.recorder.marks


def run(tensors: int, steps: int) -> None:
    trainer, reader = Trainer.remote(tensors), Reader.remote(tensors)
    rows: list[dict[str, tuple[float, float]]] = []
    for step in range(steps + 1):
        ray.get(trainer.step.remote(step + 1))
        start = time.time()
        ref = trainer.state.remote()
        consumer = ray.get(reader.load.remote([ref], step + 1))
        end = time.time()
        del ref
        if step == 0:  # the cold step: layouts and pools made
            continue
        row = {"step": (0.0, end - start)}
        for role, marks in (("producer", ray.get(trainer.marks.remote())), ("consumer", consumer)):
            for name, a, b in marks:
                row[f"{role} {name}"] = (a - start, b - start)
        rows.append(row)
    print(f"\n{tensors} tensor{'s' * (tensors > 1)}, {TOTAL >> 20} MiB, {steps} steps (ms)")
    print(f"{'call':28s} {'starts':>8s} {'ends':>8s} {'takes':>8s}")
    for key in rows[0]:
        got = [r[key] for r in rows if key in r]
        a, b = statistics.median(s for s, _ in got), statistics.median(e for _, e in got)
        print(f"{key:28s} {a * 1e3:8.2f} {b * 1e3:8.2f} {(b - a) * 1e3:8.2f}")
    ray.kill(trainer)
    ray.kill(reader)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", default="1,200,5000", help="comma-separated: 1, 200, 5000")
    parser.add_argument("--steps", type=int, default=20, help="timed steps after the cold one")
    parser.add_argument(
        "--malloc-huge-pages", action="store_true", help="small tensors on huge pages too"
    )
    args = parser.parse_args()
    counts = [int(n) for n in args.tensors.split(",")]
    for n in counts:
        if n != 1 and n not in LAYERS:
            parser.error(f"--tensors takes 1, 200 or 5000, got {n}")
    env = {"THP_MEM_ALLOC_ENABLE": "1", "PYTHONPATH": str(Path(__file__).resolve().parent)}
    if args.malloc_huge_pages:
        env["GLIBC_TUNABLES"] = MALLOC_HUGE_PAGES
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env})
    for n in counts:
        run(n, args.steps)
    ray.shutdown()


if __name__ == "__main__":
    main()
