"""Workload 11: the KV hand-off between two vLLM engines, through ``RaydirectConnector``.

The question (issue 40): how long does a decode engine (D) wait for a prompt's
KV cache computed by a prefill engine (P), through raydirect's KV connector,
against vLLM's ``NixlConnector`` and ``ExampleConnector`` and against D
prefilling the prompt itself; and what does P spend while it holds a finished
request's blocks for a reader?

A model with Llama-3.2-1B's KV geometry (16 layers, 8 KV heads, head dim 64;
the rest tiny: hidden 512, vocab 512), float32 (64 KiB of KV per token), block
size 128, prompts of 128, 512 and 2,048 tokens. Each connector has its own pair
of engines, P bound to core 0 and D to core 1 (``VLLM_CPU_OMP_THREADS_BIND``),
1 GiB of KV cache each: six engines (four without NIXL). Interleaved rounds,
the first of each size cold, a fresh prompt each time (no prefix hit anywhere),
one of each system per round:

- ``RaydirectConnector hand-off``: P prefills (``max_tokens=1``,
  ``do_remote_decode``), then D's ``generate`` of one token with P's params,
  timed in D's actor: the read of the prompt's blocks, the last prompt token's
  step, the first token. ``... transfer``: the read alone, timed in D's worker
  (``rd.read_ranges`` of every block of every layer);
- ``NixlConnector hand-off`` / ``transfer``: the same through NIXL (CPU,
  ``kv_buffer_device="cpu"``, UCX with ``num_threads: 1``); its transfer is
  NIXL's telemetry of D's read (post to completion, with the notification).
  NixlConnector pins its worker's main thread to the last core
  (``sched_setaffinity``): the affinity every engine's threads end up with is
  logged, and the NIXL transfer rows' note says where the two main threads run;
- ``ExampleConnector hand-off``: P writes each prompt's KV as safetensors files
  under ``/dev/shm``, D finds and loads them;
- ``D prefills the prompt``: D's ``generate`` of one token of a fresh prompt;
- ``floor``: one copy of the prompt's KV runs in the driver, one thread, into
  memory written before (as D's cache is): each layer's blocks, 512 KiB each.
  What no transfer of these bytes can beat on this machine.

After the rounds, for each connector that holds blocks (NIXL, then raydirect
once NIXL's engines are gone): P's CPU (engine core and worker processes,
``/proc``) over a window with nothing held, and over a window of the same length
after P finished a 512-token prompt for D and before D read it, with the
threads that used 5% of a core or more.

NIXL rows run only when asked for (``--groups nixl``) and need NIXL in the vLLM
venv. NixlConnector's progress thread spins for its engines' whole life (vLLM
leaves NIXL's poll delay at 0), one thread per engine, and this machine has two
cores: beside it every other row ran about twice as slow (docs/kv-transfer.md).
So NIXL's two engines are stopped (SIGSTOP, both processes of each) while the
other rows run, and continued 0.2 s before each of their own operations: each
row pays for its own engines, as it would on a machine with cores to spare, and
the NIXL rows still pay for their own spinning threads.
Run it there: ``.venv-vllm/bin/python benchmarks/bench.py --workloads 11
--groups raydirect,nixl``.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
import torch

from rdbench.common import (
    GROUP_NIXL,
    GROUP_RAYDIRECT,
    MIB,
    SETUP_TIMEOUT_S,
    TRANSFER_TIMEOUT_S,
    Row,
    describe_error,
    log,
)
from rdbench.fleet import Context
from rdbench.kv_holding import holding_table, main_threads, measure_holding
from rdbench.report import TargetLine, render_targets
from rdbench.vllm_shared import VLLM, installed

# The engines' side imports vLLM and raydirect.vllm: importable only where both
# are (elsewhere ``_why_not`` skips every row and says why).
if installed(VLLM) and installed("raydirect.vllm"):
    from rdbench import kv_actors

GEOMETRY = {  # Llama-3.2-1B's KV: 16 layers x 8 KV heads x head dim 64
    "hidden_size": 512,
    "intermediate_size": 256,
    "num_hidden_layers": 16,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
KV_BYTES_PER_TOKEN = 16 * 8 * 64 * 2 * 4  # layers x heads x head dim x (K, V) x float32
SIZES, QUICK_SIZES = (128, 512, 2048), (128, 512)
HOLD_TOKENS = 512
HOLD_SEED = 1 << 30  # apart from the rounds' seeds: no prefix hit
ENGINE_START_TIMEOUT_S = 600.0
RESUME_S = 0.2  # six engines start at once on 2 shared cores

RD_HANDOFF = "RaydirectConnector hand-off"
RD_TRANSFER = "RaydirectConnector transfer"
NIXL_HANDOFF = "NixlConnector hand-off"
NIXL_TRANSFER = "NixlConnector transfer"
EXAMPLE = "ExampleConnector hand-off"
PREFILL = "D prefills the prompt"
FLOOR = "floor: one copy of the prompt's KV runs"
TARGETS = [(RD_HANDOFF, NIXL_HANDOFF, 0.6), (RD_TRANSFER, NIXL_TRANSFER, 0.6)]
BLOCK_TOKENS, LAYERS = 128, GEOMETRY["num_hidden_layers"]
INSTALL = (
    "vLLM is not installed here; run: bash scripts/setup-vllm-venv.sh && "
    ".venv-vllm/bin/python benchmarks/bench.py --workloads 11"
)
NIXL_INSTALL = "NIXL is not in the vLLM venv: RAYDIRECT_VLLM_NIXL=1 bash scripts/setup-vllm-venv.sh"
NOT_ASKED = "NIXL rows run in a run of their own: --workloads 11 --groups raydirect,nixl"
OURS = {"kv_connector": "RaydirectConnector", "kv_role": "kv_both"}
NIXL = {
    "kv_connector": "NixlConnector",
    "kv_role": "kv_both",
    "kv_buffer_device": "cpu",
    "kv_connector_extra_config": {"num_threads": 1},  # UCX threads
}
NAMES = {"p": "raydirect P", "d": "raydirect D", "pe": "Example P", "de": "Example D"}
NAMES.update(pn="NIXL P", dn="NIXL D")


def kv_handoff(ctx: Context) -> list[Row]:
    """Workload 11 (the module's docstring): the sizes one after the other, the
    systems of each in interleaved rounds, then P's CPU while holding blocks."""
    sizes = QUICK_SIZES if ctx.config.quick else SIZES
    rows = {
        (s, n): Row(11, s, f"{n} tokens", n, n * KV_BYTES_PER_TOKEN, unit="us")
        for n in sizes
        for s in SYSTEMS
    }
    why = _why_not(ctx)
    for (system, _), row in rows.items():
        row.skipped = why.get("all") or why.get(system)
    if "all" in why:
        return list(rows.values())
    files = tempfile.mkdtemp(dir="/dev/shm", prefix="rdbench-kv-example-")
    engines: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="rdbench-kv-llama-") as model:
            _save_model(model)
            _start(kv_actors.KVEngine, model, files, NIXL_HANDOFF not in why, engines)
        _run(engines, rows, sizes, ctx, kv_actors)
    except Exception as exc:  # setup failed: every row not yet failed or skipped says so
        for row in rows.values():
            if row.skipped is None and row.error is None and not row.times_s:
                row.error = f"setup failed: {describe_error(exc)}"
        log(f"w11: FAILED: {describe_error(exc)}")
    finally:
        done = [e.shutdown.remote() for e in engines.values()]
        ray.wait(done, num_returns=len(done), timeout=60)  # a hung engine: killed below
        for engine in engines.values():
            ray.kill(engine)
        shutil.rmtree(files, ignore_errors=True)
    return list(rows.values())


SYSTEMS = (RD_HANDOFF, RD_TRANSFER, NIXL_HANDOFF, NIXL_TRANSFER, EXAMPLE, PREFILL, FLOOR)


def _why_not(ctx: Context) -> dict[str, str]:
    """Why rows cannot run here, by system (``all``: none of them)."""
    if not installed(VLLM):
        return {"all": INSTALL}
    if not installed("raydirect.vllm"):
        return {"all": "raydirect.vllm (the connector) is not in this raydirect"}
    why = {}
    nixl = None if ctx.config.wants(GROUP_NIXL) else NOT_ASKED
    nixl = nixl or (None if importlib.util.find_spec("nixl") else NIXL_INSTALL)
    if nixl:
        why.update({NIXL_HANDOFF: nixl, NIXL_TRANSFER: nixl})
    if not ctx.config.wants(GROUP_RAYDIRECT):
        off = "raydirect rows are not in --groups"
        why.update({RD_HANDOFF: off, RD_TRANSFER: off})
    for system, reason in why.items():
        log(f"w11 {system}: skipped: {reason}")
    return why


def _save_model(where: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**GEOMETRY)).save_pretrained(where)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(cls: Any, model: str, files: str, nixl: bool, engines: dict[str, Any]) -> None:
    """Every pair's engines at once (each takes 20-40 s alone), into ``engines``;
    NIXL's pair leaves it if it fails to start (its rows then say so)."""
    example = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": files},
    }
    log(f"w11: starting {6 if nixl else 4} engines")
    for key, config in (("p", OURS), ("d", OURS), ("pe", example), ("de", example)):
        engines[key] = cls.remote(model, "0" if key.startswith("p") else "1", config)
    if nixl:
        for key, core in (("pn", "0"), ("dn", "1")):
            env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(_free_port())}
            engines[key] = cls.remote(model, core, NIXL, env)
    ours = [engines[k].__ray_ready__.remote() for k in ("p", "d", "pe", "de")]
    ray.get(ours, timeout=ENGINE_START_TIMEOUT_S)
    if nixl:
        try:
            theirs = [engines[k].__ray_ready__.remote() for k in ("pn", "dn")]
            ray.get(theirs, timeout=ENGINE_START_TIMEOUT_S)
        except Exception as exc:  # the other rows still run
            log(f"w11: NixlConnector's engines did not start: {describe_error(exc)}")
            for key in ("pn", "dn"):
                ray.kill(engines.pop(key))


def _prompt(n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, GEOMETRY["vocab_size"], (n,), generator=generator).tolist()


def _run(
    engines: dict[str, Any],
    rows: dict[tuple[str, int], Row],
    sizes: Sequence[int],
    ctx: Context,
    kv_actors: Any,
) -> None:
    """Affinity, the rounds, then P's CPU while it holds blocks."""
    mains = main_threads(engines, NAMES)
    if "pn" in engines:
        note = f"its worker's main thread runs on CPU {mains.get('pn')} in P (bound to 0)"
        note += f", {mains.get('dn')} in D (bound to 1): NixlConnector sets its affinity"
        for n in sizes:
            rows[(NIXL_TRANSFER, n)].note = note
    elif rows[(NIXL_HANDOFF, sizes[0])].skipped is None:
        for n in sizes:
            for system in (NIXL_HANDOFF, NIXL_TRANSFER):
                rows[(system, n)].error = "NixlConnector's engines did not start (see the log)"
    ops = _operations(engines, kv_actors)
    for n in sizes:
        family = {s: rows[(s, n)] for s in SYSTEMS}
        _rounds(family, ops, n, ctx)
    hold = HOLD_TOKENS if HOLD_TOKENS in sizes else sizes[0]
    samples = 1 if ctx.config.quick else 3
    # NIXL's first, then its engines go: their progress threads spin on both
    # cores, and a window on a busy machine measures the share P got, not its need.
    for system, p, d in ((NIXL_HANDOFF, "pn", "dn"), (RD_HANDOFF, "p", "d")):
        row = rows[(system, hold)]
        if p == "pn" and p in engines:
            _pause([engines["pn"], engines["dn"]], False)
        if p in engines and row.error is None and row.skipped is None:
            prompts = [_prompt(hold, HOLD_SEED + i) for i in range(samples)]
            measure_holding(engines[p], engines[d], row, prompts)
        if p == "pn" and p in engines:
            nixl = [engines.pop(k) for k in ("pn", "dn")]
            ray.wait([e.shutdown.remote() for e in nixl], num_returns=2, timeout=60)
            for engine in nixl:
                ray.kill(engine)


Operation = Callable[[list[int]], dict[str, float]]


def _operations(engines: dict[str, Any], kv_actors: Any) -> dict[str, Operation]:
    """One timed operation per family of rows, each giving seconds by system."""
    ops: dict[str, Operation] = {}

    def generate(key: str, ids: list[int], params: dict[str, Any] | None) -> tuple[float, Any]:
        return ray.get(engines[key].generate.remote(ids, params), timeout=TRANSFER_TIMEOUT_S)

    def handed_off(p: str, d: str, ids: list[int]) -> tuple[float, str]:
        _, params = generate(p, ids, {"do_remote_decode": True})
        return generate(d, ids, params)[0], str(params["remote_request_id"])

    def raydirect(ids: list[int]) -> dict[str, float]:
        seconds, request = handed_off("p", "d", ids)
        reads = ray.get(engines["d"].rpc.remote(kv_actors.raydirect_reads), timeout=SETUP_TIMEOUT_S)
        [read] = [r for r in reads if r["remote"] == request]
        return {RD_HANDOFF: seconds, RD_TRANSFER: read["seconds"]}

    def nixl(ids: list[int]) -> dict[str, float]:
        seconds, _ = handed_off("pn", "dn", ids)
        reads = ray.get(engines["dn"].rpc.remote(kv_actors.nixl_reads), timeout=SETUP_TIMEOUT_S)
        if not reads:
            raise RuntimeError("NIXL's telemetry recorded no transfer for this hand-off")
        return {NIXL_HANDOFF: seconds, NIXL_TRANSFER: sum(r["seconds"] for r in reads)}

    def example(ids: list[int]) -> dict[str, float]:
        generate("pe", ids, None)  # writes the prompt's KV files
        return {EXAMPLE: generate("de", ids, None)[0]}  # finds and loads them

    def prefill(ids: list[int]) -> dict[str, float]:
        return {PREFILL: generate("d" if "d" in engines else "de", ids, None)[0]}

    if "d" in engines:
        ops[RD_HANDOFF] = raydirect
    ops[PREFILL] = prefill
    ops[FLOOR] = _floor()
    ops[EXAMPLE] = example
    if "dn" in engines:
        ray.get(engines["dn"].rpc.remote(kv_actors.nixl_reads), timeout=SETUP_TIMEOUT_S)  # records
        ops[NIXL_HANDOFF] = _while_continued([engines["pn"], engines["dn"]], nixl)
        _pause([engines["pn"], engines["dn"]], True)
    return ops


def _pause(nixl: list[Any], paused: bool) -> None:
    ray.get([e.pause.remote(paused) for e in nixl], timeout=SETUP_TIMEOUT_S)


def _while_continued(nixl: list[Any], op: Operation) -> Operation:
    """``op`` with NIXL's engines continued around it (the module's docstring)."""

    def continued(ids: list[int]) -> dict[str, float]:
        _pause(nixl, False)
        time.sleep(RESUME_S)  # its threads are running again before the clock starts
        try:
            return op(ids)
        finally:
            _pause(nixl, True)

    return continued


def _floor() -> Operation:
    """The floor row's operation (the module's docstring)."""
    run = BLOCK_TOKENS * KV_BYTES_PER_TOKEN // LAYERS  # one layer's block: 512 KiB
    src = torch.ones(LAYERS, max(SIZES) // BLOCK_TOKENS, run, dtype=torch.uint8)
    dst = torch.zeros_like(src)

    def copy(ids: list[int]) -> dict[str, float]:
        blocks = -(-len(ids) // BLOCK_TOKENS)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            start = time.perf_counter()
            for layer in range(LAYERS):
                dst[layer, :blocks].copy_(src[layer, :blocks])
            return {FLOOR: time.perf_counter() - start}
        finally:
            torch.set_num_threads(threads)

    return copy


def _rounds(family: dict[str, Row], ops: dict[str, Operation], n: int, ctx: Context) -> None:
    """One cold operation of each family, then ``--kv-rounds`` rounds of one each,
    a fresh prompt for every operation; a family that fails leaves the rounds."""
    live = {k: op for k, op in ops.items() if family[k].skipped is None and family[k].error is None}
    rounds = ctx.config.kv_rounds
    log(f"w11 @ {n} tokens: {len(live)} families of rows, 1 cold + {rounds} interleaved rounds")
    for i in range(rounds + 1):
        for key, op in list(live.items()):
            try:
                got = op(_prompt(n, next(ctx.seed_iter)))
            except Exception as exc:
                family[key].error = describe_error(exc)
                log(f"w11 {key} @ {n} tokens: FAILED: {family[key].error}")
                del live[key]
                continue
            for system, seconds in got.items():
                if i == 0:
                    family[system].cold_s = seconds
                else:
                    family[system].times_s.append(seconds)
    for system, row in family.items():
        if row.times_s and row.error is None:
            log(f"w11 {system} @ {n} tokens: median {statistics.median(row.times_s) * 1e3:.1f} ms")


def kv_targets(rows: Sequence[Row]) -> str:
    """Issue 40's targets at each size (ratios of medians), the KV moved, and P's
    CPU while it holds blocks; the NIXL rows' affinity note."""
    ms = {
        (r.system, r.param): statistics.median(r.times_s)
        for r in rows
        if r.times_s and r.error is None
    }
    lines = []
    for point in dict.fromkeys(r.param for r in rows):
        for mine, base, bound in TARGETS:
            a, b = ms.get((mine, point)), ms.get((base, point))
            got = a / b if a is not None and b else None
            copy = ms.get((FLOOR, point)) if mine == RD_TRANSFER else None
            floor = copy / b if copy is not None and b else None
            lines.append(TargetLine(f"{mine} / {base}", bound, True, point, got, floor))
    title = "Targets (ratios of median times in this run; a transfer's floor: one copy):"
    parts = [render_targets(lines, title), holding_table(rows)]
    kv = ", ".join(f"{r.param}: {r.nbytes / MIB:.0f} MiB" for r in rows if r.system == RD_HANDOFF)
    parts.append(f"KV per prompt (16 layers x 8 heads x 64 x K, V x float32): {kv}.")
    notes = {r.note for r in rows if r.system == NIXL_TRANSFER and r.note and r.times_s}
    parts += [f"NixlConnector: {note}." for note in sorted(notes)]
    return "\n\n".join(p for p in parts if p)
