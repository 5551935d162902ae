"""Workload 9: one whole weight update of a vLLM engine.

The question (issue 31): how long does one update of a float32 Llama of about
320 MiB (hidden 1024, 6 layers, vocab 8192) take through vLLM's weight-transfer
API with the ``"raydirect"`` backend (``trainer.send_weights()``: publish, the
engine's start/update/finish, the workers' pulls and loads), against

- (a) the naive path: the trainer writes its full state dict as safetensors to
  /dev/shm, and every worker reads the file back and runs ``load_weights`` under
  vLLM's layerwise reload (``initialize_layerwise_reload`` /
  ``finalize_layerwise_reload``, as its nccl engine does);
- (b) the floor: the worker's ``load_weights`` of tensors already in its own
  memory, under the same layerwise reload (timed inside the worker: no call);

and does each worker of a tensor-parallel engine receive only its slice, and
each rank of an FSDP2 trainer send only its shards? And (issue 39) how long
does an update stop the engine? The backend receives while the engine serves;
only its load stops it. At tensor parallel 1 and 2, each system's update in
every round is followed by one more while a request streams, and its **stall**
is the longest gap between two of the request's tokens that overlaps the update
(``rdbench.vllm_stall``), set beside the update's time and the gap between
tokens with no update; the target is raydirect's stall at most 1.2x the floor's.

Points: tensor parallel 1 and 2 (one trainer process holding the model,
vLLM's ``ModuleSource``), and a 2-rank FSDP2 trainer on gloo into a
tensor-parallel-1 engine, through ``raydirect.vllm.ShardedModuleSource`` and
through vLLM's ``ModuleSource`` (vLLM 0.32's iteration gathers every tensor with
``full_tensor()`` on every rank; the backend reads it as its shards, so each
rank publishes its own with either). Each system of the FSDP2 point has
an engine of its own (an engine takes one trainer at a time).

The systems of a point run in interleaved rounds, one update of each in turn.
Untimed before each update, the trainer adds 1/16 to every parameter in place;
after it, each worker's final norm and the first rows of its slice of the
embedding are compared with the trainer's, exactly. Timed from the driver: (a) from the file's
write to the last worker's load, raydirect from ``send_weights()``'s call to its
return (on every rank). GB/s counts the model's bytes. Bytes moved, per worker
(``rd.local_stats()`` in each worker) and per trainer rank, are counted over one
update, untimed, and set beside its parameters' bytes.

Run it in the vLLM venv: ``bash scripts/setup-vllm-venv.sh && .venv-vllm/bin/python
benchmarks/bench.py --workloads 9``.
"""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from rdbench.common import SETUP_TIMEOUT_S, TRANSFER_TIMEOUT_S, Row, describe_error, log
from rdbench.fleet import Context
from rdbench.report import TargetLine, render_targets
from rdbench.vllm_shared import DELTA, MAX_MODEL_LEN, VLLM, installed

# The engine's and trainers' side imports vLLM: importable only where vLLM is
# installed (elsewhere the workload's rows say how to get it). The import is
# one way: vllm_actors takes what both sides share from vllm_shared.
if installed(VLLM):
    from rdbench import vllm_actors
from rdbench.vllm_stall import (
    Update,
    measure,
    median_stall,
    record,
    render_stalls,
    warm_up,
    window,
)

LLAMA = {  # ~320 MiB in float32: 6 x 11.2 M + 2 x 8.4 M parameters
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 6,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "vocab_size": 8192,
    "max_position_embeddings": MAX_MODEL_LEN,  # RoPE: no weights; the streamed request's room
    "tie_word_embeddings": False,
}
QUICK_LLAMA = {  # ~21 MiB; heads of 32 (vLLM's CPU attention serves no narrower head)
    **LLAMA,
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
}
ENGINE_START_TIMEOUT_S = 600.0  # four engines start at once on 2 shared cores
SHM_FILE = "/dev/shm/rdbench-vllm-update.safetensors"

RAYDIRECT = "raydirect backend, send_weights()"
NAIVE = "(a) safetensors in /dev/shm, then load_weights"
FLOOR = "floor (b): load_weights of tensors in memory"
FLOOR_COPY = "floor (c): one copy of the worker's share, then (b)"
SHARDED = "raydirect backend, ShardedModuleSource"
GATHERED = "raydirect backend, ModuleSource (read as shards)"
TP1, TP2, FSDP = "tensor parallel 1", "tensor parallel 2", "FSDP2 2 ranks -> tensor parallel 1"
WORKER_BYTES = "worker bytes / its parameters"
RANK_BYTES = "bytes sent / model, rank "
TARGETS = [(RAYDIRECT, NAIVE, 0.75), (RAYDIRECT, FLOOR, 1.3)]
STALL_TARGETS = [(RAYDIRECT, FLOOR, 1.2)]  # medians of the stall, not of the update's time
INSTALL = (
    "vLLM is not installed here; run: bash scripts/setup-vllm-venv.sh && "
    ".venv-vllm/bin/python benchmarks/bench.py --workloads 9"
)


def vllm_missing() -> str | None:
    return None if installed(VLLM) else INSTALL


def backend_missing() -> str | None:
    if not installed("raydirect.vllm"):
        return "raydirect.vllm (the backend) is not in this raydirect"
    return None


@dataclass
class _Model:
    """The checkpoint every process starts from, and what the check expects."""

    path: str
    nbytes: int
    vector_bytes: int  # the norms: whole on every tensor-parallel worker; the rest is split
    norm: torch.Tensor
    embed: torch.Tensor  # the first rows of each tensor-parallel-2 worker's slice, as saved
    deltas: dict[str, int] = field(default_factory=dict)  # trainer -> deltas applied

    def worker_bytes(self, tp: int) -> int:
        """A worker's share at tensor parallel ``tp``: every matrix of a Llama is
        split over the workers, every vector whole on each."""
        return self.vector_bytes + (self.nbytes - self.vector_bytes) // tp


def _save_model(config: dict[str, Any], where: str) -> _Model:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config)).to(torch.float32)
    model.save_pretrained(where)
    state = model.state_dict()
    embed = state["model.embed_tokens.weight"]
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    half = embed.shape[0] // 2
    firsts = torch.stack([embed[:4], embed[half : half + 4]]).clone()
    vectors = sum(t.numel() * t.element_size() for t in state.values() if t.dim() == 1)
    return _Model(where, nbytes, vectors, state["model.norm.weight"].clone(), firsts)


def _check(model: _Model, trainer: str, got: list[dict[str, Any]], tp: int) -> None:
    """Each worker's samples equal the trainer's tensors after its deltas."""
    norm, embed = model.norm.clone(), model.embed.clone()
    for _ in range(model.deltas.get(trainer, 0)):  # the trainer's own float32 sums
        norm.add_(DELTA)
        embed.add_(DELTA)
    for sample in got:
        rank = sample["rank"]
        want = embed[0] if tp == 1 or rank == 0 else embed[1]
        if not torch.equal(sample["norm"], norm) or not torch.equal(sample["embed"], want):
            raise ValueError(
                f"worker {rank}: weights differ from trainer {trainer}'s after "
                f"{model.deltas.get(trainer, 0)} steps (largest difference: final norm "
                f"{(sample['norm'] - norm).abs().max():.3g}, "
                f"embedding {(sample['embed'] - want).abs().max():.3g})"
            )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Fleet:
    """The engines and trainers of one point at a time: on a machine of 24 GiB
    shared with others, four engines at once ran it out of memory (each is three
    processes importing torch and vLLM, beside its model and 1 GiB of KV cache)."""

    def __init__(self, actors: Any, model: _Model, backend: bool) -> None:
        self.actors, self.model, self.backend = actors, model, backend
        self.engines: dict[str, Any] = {}
        self.trainer: Any = None
        self.ranks: list[Any] = []

    def start(self, point: str) -> None:
        """Start ``point``'s engines (and its trainer, or ranks) at once, and connect
        them (each engine takes 18-40 s alone)."""
        path, a = self.model.path, self.actors
        if point == FSDP:
            self.engines = {s: a.Engine.remote(path, True) for s in (SHARDED, GATHERED)}
            address = f"tcp://127.0.0.1:{_free_port()}"
            self.ranks = [a.FsdpRank.remote(path, r, 2, address) for r in range(2)]
        else:
            tp = 2 if point == TP2 else 1
            self.engines = {point: a.Engine.remote(path, self.backend, tensor_parallel_size=tp)}
            self.trainer = self.trainer or a.Trainer.remote(path)
        every = [*self.engines.values(), *([self.trainer] if self.trainer else []), *self.ranks]
        ray.get([x.__ray_ready__.remote() for x in every], timeout=ENGINE_START_TIMEOUT_S)
        if not self.backend:
            return
        if point == FSDP:
            calls = [
                r.connect.remote([self.engines[system]], _name(system), system == SHARDED)
                for system in (SHARDED, GATHERED)
                for r in self.ranks
            ]
        else:
            calls = [self.trainer.connect.remote([self.engines[point]], _name(point))]
        ray.get(calls, timeout=SETUP_TIMEOUT_S)

    def stop(self, trainer: bool = False) -> None:
        """Kill the point's engines (and ranks; the trainer too if asked)."""
        for actor in [*self.engines.values(), *self.ranks]:
            ray.kill(actor)
        self.engines, self.ranks = {}, []
        if trainer and self.trainer is not None:
            ray.kill(self.trainer)
            self.trainer = None

    def close(self) -> None:
        self.stop(trainer=True)
        if os.path.exists(SHM_FILE):
            os.unlink(SHM_FILE)


def _name(system_or_point: str) -> str:
    """The name of the trainer engine (and its mailbox actor) for a row's engine."""
    names = {TP1: "tp1", TP2: "tp2", SHARDED: "fsdp-sharded", GATHERED: "fsdp-module-source"}
    return f"rdbench-{names[system_or_point]}"


def vllm_update(ctx: Context) -> list[Row]:
    """Workload 9 (the module's docstring): the points one after the other, the
    systems of each in interleaved rounds."""
    quick = ctx.config.quick
    systems = (RAYDIRECT, NAIVE, FLOOR, FLOOR_COPY)
    rows = [Row(9, s, p, x, 0) for x, p in enumerate((TP1, TP2)) for s in systems]
    rows += [Row(9, s, FSDP, 2, 0) for s in (SHARDED, GATHERED)]
    missing = vllm_missing()
    if missing:
        for row in rows:
            row.skipped = missing
        return rows
    no_backend = backend_missing()
    if no_backend:
        for row in rows:
            if row.system not in (NAIVE, FLOOR, FLOOR_COPY):
                row.skipped = no_backend
    with tempfile.TemporaryDirectory(prefix="rdbench-llama-") as where:
        model = _save_model(QUICK_LLAMA if quick else LLAMA, where)
        log(f"w9: a float32 Llama of {model.nbytes / (1 << 20):.0f} MiB in {where}")
        for row in rows:
            row.nbytes = model.nbytes
        fleet = _Fleet(vllm_actors, model, backend=no_backend is None)
        repeats = ctx.config.repeats(model.nbytes)
        try:
            for point in (TP1, TP2, FSDP):
                family = {r.system: r for r in rows if r.param == point and not r.skipped}
                if not family:
                    continue
                log(f"w9 {point}: starting its engine(s) and trainer")
                fleet.stop(trainer=point == FSDP)
                try:
                    fleet.start(point)
                except Exception as exc:
                    for row in family.values():
                        row.error = f"setup failed: {describe_error(exc)}"
                    continue
                ops = _operations(fleet, point, family)
                streams = None if point == FSDP else fleet.engines[point]
                _rounds(family, ops, repeats, streams)
                _count_bytes(fleet, point, family, ops)
        finally:
            fleet.close()
    return rows


def _operations(
    fleet: _Fleet, point: str, family: dict[str, Row]
) -> dict[str, Callable[[], Update]]:
    """One timed update of each system at ``point``; each checks the engine after
    (untimed, outside its window)."""
    model, a = fleet.model, fleet.actors
    tp = 2 if point == TP2 else 1

    def checked(engine: Any, trainer: str) -> None:
        got = ray.get(engine.rpc.remote(a.samples), timeout=SETUP_TIMEOUT_S)
        _check(model, trainer, got, tp)

    def step(actors: list[Any], trainer: str) -> None:
        ray.get([x.step.remote() for x in actors], timeout=SETUP_TIMEOUT_S)
        model.deltas[trainer] = model.deltas.get(trainer, 0) + 1

    def raydirect(engine: Any, actors: list[Any], name: str, trainer: str) -> Callable[[], Update]:
        def op() -> Update:
            step(actors, trainer)
            _, start, end = window(
                lambda: ray.get([x.send.remote(name) for x in actors], timeout=TRANSFER_TIMEOUT_S)
            )
            checked(engine, trainer)
            return Update(end - start, start, end)

        return op

    ops: dict[str, Callable[[], Update]] = {}
    if point == FSDP:
        for system in (SHARDED, GATHERED):
            # one model on the ranks, stepped by both systems: one count of its deltas
            ops[system] = raydirect(fleet.engines[system], fleet.ranks, _name(system), "fsdp")
        return ops
    engine = fleet.engines[point]
    trainer = fleet.trainer
    if RAYDIRECT in family:
        ops[RAYDIRECT] = raydirect(engine, [trainer], _name(point), "trainer")

    def naive() -> Update:
        step([trainer], "trainer")

        def save_and_load() -> None:
            ray.get(trainer.save.remote(SHM_FILE), timeout=TRANSFER_TIMEOUT_S)
            ray.get(engine.rpc.remote(a.reload_from_file, SHM_FILE), timeout=TRANSFER_TIMEOUT_S)

        _, start, end = window(save_and_load)
        checked(engine, "trainer")
        return Update(end - start, start, end)

    def floor() -> Update:
        # timed inside each worker (no call); its window, for the stall, is the call's
        seconds, start, end = window(
            lambda: ray.get(engine.rpc.remote(a.reload_stash), timeout=TRANSFER_TIMEOUT_S)
        )
        return Update(max(seconds), start, end)

    def floor_copy() -> Update:
        seconds, start, end = window(
            lambda: ray.get(
                engine.rpc.remote(a.reload_stash_after_copy), timeout=TRANSFER_TIMEOUT_S
            )
        )
        return Update(max(seconds), start, end)

    ops[NAIVE] = naive
    ops[FLOOR] = floor
    ops[FLOOR_COPY] = floor_copy
    # The floors' tensors: the trainer's file, read into each worker once, untimed;
    # and (c)'s buffer of the bytes each worker receives in an update.
    ray.get(trainer.save.remote(SHM_FILE), timeout=SETUP_TIMEOUT_S)
    ray.get(engine.rpc.remote(a.stash_file, SHM_FILE), timeout=SETUP_TIMEOUT_S)
    ray.get(engine.rpc.remote(a.stash_share, model.worker_bytes(tp)), timeout=SETUP_TIMEOUT_S)
    return ops


def _rounds(
    family: dict[str, Row], ops: dict[str, Callable[[], Update]], repeats: int, streams: Any
) -> None:
    """One cold update of each system, then ``repeats`` rounds of one each. With
    an engine to stream from (``streams``), each system's update in every round,
    the cold one's too, is followed by one more while a request streams, for the
    stall (``rdbench.vllm_stall``; its time is not in the row's times: the
    request's steps share the machine's two cores with it)."""
    live = {s: op for s, op in ops.items() if s in family}
    if streams is not None:
        warm_up(streams)
    for i in range(repeats + 1):
        for system, op in list(live.items()):
            row = family[system]
            try:
                seconds = op().seconds
                if streams is not None:
                    record(row, measure(streams, op))
            except Exception as exc:
                row.error = describe_error(exc)
                log(f"w9 {system} @ {row.param}: FAILED: {row.error}")
                del live[system]
                continue
            if i == 0:
                row.cold_s = seconds
            else:
                row.times_s.append(seconds)
    for system in live:
        row = family[system]
        if row.times_s:
            ms = statistics.median(row.times_s) * 1e3
            stall = median_stall(row)
            also = "" if stall is None else f", stall {stall * 1e3:.0f} ms while streaming"
            log(f"w9 {system} @ {row.param}: median {ms:.0f} ms{also}")


def _count_bytes(
    fleet: _Fleet, point: str, family: dict[str, Row], ops: dict[str, Callable[[], Update]]
) -> None:
    """One more update of each raydirect row, untimed, counting the bytes each
    worker received (over its parameters' bytes) and each trainer rank sent (over
    the model's bytes)."""
    for system in (RAYDIRECT, SHARDED, GATHERED):
        row = family.get(system)
        if row is None or row.error is not None or system not in ops:
            continue
        engine = fleet.engines[point if system == RAYDIRECT else system]
        senders = fleet.ranks if point == FSDP else [fleet.trainer]
        try:
            workers = ray.get(engine.rpc.remote(fleet.actors.received), timeout=SETUP_TIMEOUT_S)
            sent = ray.get([x.bytes_sent.remote() for x in senders], timeout=SETUP_TIMEOUT_S)
            ops[system]()
            after = ray.get(engine.rpc.remote(fleet.actors.received), timeout=SETUP_TIMEOUT_S)
            sent_after = ray.get([x.bytes_sent.remote() for x in senders], timeout=SETUP_TIMEOUT_S)
        except Exception as exc:
            row.error = f"counting bytes: {describe_error(exc)}"
            continue
        # vLLM's own parameters cannot be counted: on CPU it repacks every linear
        # layer's weight for oneDNN and leaves the parameter empty.
        share = fleet.model.worker_bytes(2 if point == TP2 else 1)
        row.measured[WORKER_BYTES] = max(b - a for a, b in zip(workers, after, strict=True)) / share
        for rank, (a, b) in enumerate(zip(sent, sent_after, strict=True)):
            row.measured[f"{RANK_BYTES}{rank}"] = (b - a) / fleet.model.nbytes


def vllm_targets(rows: Sequence[Row]) -> str:
    """The issue's targets at each tensor-parallel point (ratios of median update
    times, and of median stalls), the stall table, and the bytes moved."""
    ms = {
        (r.system, r.param): statistics.median(r.times_s)
        for r in rows
        if r.times_s and r.error is None
    }
    by_key = {(r.system, r.param): r for r in rows}
    lines: list[TargetLine] = []
    for point in (TP1, TP2):
        for mine, base, bound in TARGETS:
            a, b = ms.get((mine, point)), ms.get((base, point))
            got = a / b if a is not None and b else None
            # beside the floor's target, floor (c)'s own ratio: the bytes must move
            c = ms.get((FLOOR_COPY, point)) if base == FLOOR else None
            own = c / b if c is not None and b else None
            lines.append(
                TargetLine(f"raydirect / {base.split(',')[0]}", bound, True, point, got, own)
            )
        for mine, base, bound in STALL_TARGETS:
            a, b = median_stall(by_key.get((mine, point))), median_stall(by_key.get((base, point)))
            got = a / b if a is not None and b else None
            what = f"raydirect's stall / {base.split(':')[0]}'s stall"
            lines.append(TargetLine(what, bound, True, point, got, None))
    title = "Targets (ratios of median update times, and of median stalls, in this run):"
    parts = [render_targets(lines, title), render_stalls(rows, FLOOR)]
    counted = [r for r in rows if WORKER_BYTES in r.measured]
    if counted:
        table = "Bytes moved in one update (rd.local_stats(), untimed):\n\n"
        table += "| point | system | measured |\n|---|---|---|\n"
        table += "\n".join(
            f"| {r.param} | {r.system} | "
            + ", ".join(
                f"{k} {v:.2f}"
                for k, v in r.measured.items()
                if k == WORKER_BYTES or k.startswith(RANK_BYTES)
            )
            + " |"
            for r in counted
        )
        parts.append(table)
    return "\n\n".join(p for p in parts if p)
