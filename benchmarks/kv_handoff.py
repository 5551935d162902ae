"""The KV hand-off of ``RaydirectConnector`` between two vLLM engines on CPU.

A model with Llama-3.2-1B's KV geometry (16 layers, 8 KV heads, head dim 64; the
rest tiny: hidden 512, vocab 512), float32 (64 KiB of KV per token), prompts of
128, 512 and 2,048 tokens. Interleaved rounds, a fresh prompt each time (no
prefix-cache hit anywhere), each of:

- ``hand-off``: P prefills (``max_tokens=1``, ``do_remote_decode``), then D's
  ``generate`` of one token with P's params is timed, as the driver sees it: the
  read of the prompt's blocks, the last prompt token's step, the first token;
- ``transfer``: the read alone, timed in D's worker (``rd.read_ranges`` of every
  block of every layer, and the notice);
- ``Example``: the same hand-off through vLLM's ``ExampleConnector`` (P writes
  each prompt's KV as safetensors files under ``/dev/shm``, D finds and loads
  them), another pair of engines: D's ``generate`` of one token;
- ``NIXL``: the same hand-off through vLLM's ``NixlConnector`` (CPU,
  ``kv_buffer_device="cpu"``, UCX with ``num_threads=1``), a third pair of
  engines: D's ``generate`` of one token with P's params; and ``NIXL transfer``,
  its read alone (NIXL's telemetry of D's transfer: post to completion, with the
  notification). Its first hand-off does NIXL's handshake: it is printed, not
  counted (as every size's first round). NixlConnector pins each worker's main
  thread to the last core of its NUMA node: the affinity every engine's threads
  end up with is printed;
- ``D prefills``: D's ``generate`` of one token of a fresh prompt with no params.

Also P's CPU (its engine core and worker processes) while it holds a request's
blocks for a reader that has not come (vLLM's engine loop keeps stepping), against
P idle, for raydirect's P and NIXL's, and the threads of NIXL's engines that use
CPU while idle.

Needs vLLM: ``.venv-vllm/bin/python benchmarks/kv_handoff.py [--rounds 5]``; the
NIXL rows need NIXL in that venv (``RAYDIRECT_VLLM_NIXL=1
scripts/setup-vllm-venv.sh``), else they are skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import socket
import statistics
import tempfile
import time
from typing import Any

import ray
import torch

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
SIZES = (128, 512, 2048)
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB per engine: 8,192 tokens here, six engines
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}
NIXL_INSTALL = "RAYDIRECT_VLLM_NIXL=1 scripts/setup-vllm-venv.sh"
ROWS = ("hand-off", "transfer", "NIXL", "NIXL transfer", "Example", "D prefills")


@ray.remote(num_cpus=0)
class Engine:
    def __init__(
        self,
        model: str,
        core: str,
        kv_transfer_config: dict[str, Any],
        env: dict[str, str] | None = None,
    ) -> None:
        os.environ.update(ENV, VLLM_CPU_OMP_THREADS_BIND=core, **(env or {}))
        os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
        from vllm import LLM

        self.llm = LLM(
            model=model,
            dtype="float32",
            skip_tokenizer_init=True,
            max_model_len=4096,
            enforce_eager=True,
            block_size=128,
            kv_transfer_config=kv_transfer_config,
        )

    def generate(self, ids: list[int], params: dict | None) -> tuple[float, dict | None]:
        from vllm import SamplingParams

        extra = None if params is None else {"kv_transfer_params": params}
        sampling = SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra)
        started = time.perf_counter()
        [out] = self.llm.generate({"prompt_token_ids": ids}, sampling, use_tqdm=False)
        return time.perf_counter() - started, out.kv_transfer_params

    def reads(self) -> list[dict[str, Any]]:
        def read(_worker: Any) -> list[dict[str, Any]]:
            from raydirect.vllm import kv_worker

            return [r for w in kv_worker.status() for r in w["reads"]]

        return [r for rank in self.llm.collective_rpc(read) for r in rank]

    def nixl_reads(self) -> list[dict[str, Any]]:
        """NIXL's telemetry of the transfers D's worker finished since the last call."""

        def take(_worker: Any) -> list[dict[str, Any]]:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            # On the class: the stats object itself travels to the scheduler (pickled).
            stats = type(get_kv_transfer_group().connector_worker.xfer_stats)
            if not hasattr(stats, "bench_reads"):  # first call: record from now on
                stats.bench_reads = []
                record = stats.record_transfer

                def recording(self: Any, res: Any) -> None:
                    if res is not None:
                        stats.bench_reads.append(
                            {
                                "seconds": res.xferDuration / 1e6,
                                "post": res.postDuration / 1e6,
                                "bytes": res.totalBytes,
                            }
                        )
                    record(self, res)

                stats.record_transfer = recording
            taken, stats.bench_reads[:] = list(stats.bench_reads), []
            return taken

        return [r for rank in self.llm.collective_rpc(take) for r in rank]

    def pids(self) -> tuple[int, int]:
        """The engine's worker process and its parent, the engine core."""

        def pid(_worker: Any) -> int:
            return os.getpid()

        [worker] = self.llm.collective_rpc(pid)
        return worker, int(_stat(worker)[1])

    def threads(self) -> list[tuple[str, str, str, float]]:
        """(process, thread name, CPUs allowed, CPU seconds) of every thread of both."""
        rows = []
        for proc, pid in zip(("worker", "core"), self.pids(), strict=True):
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    fields = _stat(int(tid), pid)
                    with open(f"/proc/{pid}/task/{tid}/status") as f:
                        status = dict(line.split(":\t", 1) for line in f if ":\t" in line)
                    with open(f"/proc/{pid}/task/{tid}/comm") as f:
                        name = f.read().strip()
                except (FileNotFoundError, ProcessLookupError):
                    continue  # a thread that ended meanwhile
                used = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
                allowed = status["Cpus_allowed_list"].strip()
                name = "main" if int(tid) == pid else name
                rows.append((proc, f"{name}/{tid}", allowed, used))
        return rows

    def cpu_seconds(self) -> float:
        """CPU seconds the engine's core and worker processes have used."""
        used = 0.0
        for pid in self.pids():
            fields = _stat(pid)
            used += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return used

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def _stat(pid: int, parent: int | None = None) -> list[str]:
    """/proc/PID/stat's fields after the command (state first: ppid is [1])."""
    path = f"/proc/{pid}/stat" if parent is None else f"/proc/{parent}/task/{pid}/stat"
    with open(path) as f:
        return f.read().split(") ", 1)[1].split()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _cpu_share(engine: Any, seconds: float) -> float:
    before = ray.get(engine.cpu_seconds.remote())
    time.sleep(seconds)  # measuring, not synchronising
    return (ray.get(engine.cpu_seconds.remote()) - before) / seconds


def _why(exc: BaseException) -> str:
    """The last lines of an error (a Ray task's error carries the remote traceback)."""
    return " | ".join(str(exc).strip().splitlines()[-3:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-nixl", action="store_true", help="leave NixlConnector out")
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    nixl = not args.no_nixl and importlib.util.find_spec("nixl") is not None
    print(f"load average before: {_load()} ({os.cpu_count()} cores)")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    with tempfile.TemporaryDirectory() as model:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**GEOMETRY)).save_pretrained(model)
        ours = {"kv_connector": "RaydirectConnector", "kv_role": "kv_both"}
        files = tempfile.mkdtemp(dir="/dev/shm", prefix="kv-example-")
        example = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": files},
        }
        engines = {
            "p": Engine.remote(model, "0", ours),
            "d": Engine.remote(model, "1", ours),
            "pe": Engine.remote(model, "0", example),
            "de": Engine.remote(model, "1", example),
        }
        if nixl:
            theirs = {
                "kv_connector": "NixlConnector",
                "kv_role": "kv_both",
                "kv_buffer_device": "cpu",
                "kv_connector_extra_config": {"num_threads": 1},  # UCX threads
            }
            for name, core in (("pn", "0"), ("dn", "1")):
                env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(_free_port())}
                engines[name] = Engine.remote(model, core, theirs, env)
        try:
            ray.get([engines[k].pids.remote() for k in ("p", "d", "pe", "de")])  # started
            if nixl:
                try:
                    ray.get([engines[k].pids.remote() for k in ("pn", "dn")])
                except Exception as exc:  # the other rows still run; say what failed
                    print(f"NixlConnector's engines did not start: {_why(exc)}")
                    for k in ("pn", "dn"):
                        ray.kill(engines.pop(k))
            _run(engines, rounds=args.rounds)
        finally:
            done = [e.shutdown.remote() for e in engines.values()]
            ray.wait(done, num_returns=len(done), timeout=60)  # a hung engine: ray.shutdown
            shutil.rmtree(files, ignore_errors=True)
    if not nixl:
        why = "--no-nixl" if args.no_nixl else f"NIXL is not installed: {NIXL_INSTALL}"
        print(f"NixlConnector rows skipped ({why})")
    ray.shutdown()


def _run(engines: dict[str, Any], rounds: int) -> None:
    p, d, pe, de = (engines[k] for k in ("p", "d", "pe", "de"))
    pn, dn = engines.get("pn"), engines.get("dn")
    _affinity(engines)
    if pn is not None:
        ray.get(dn.nixl_reads.remote())  # starts recording
    times: dict[tuple[str, int], list[float]] = {}
    cold: dict[str, float] = {}
    seed, nixl_mib = 0, 0.0
    for n in SIZES:
        for r in range(rounds + 1):  # the first round is the cold one: not counted
            seed += 4
            ids = _prompt(n, seed)
            _, params = ray.get(p.generate.remote(ids, {"do_remote_decode": True}))
            handoff, _ = ray.get(d.generate.remote(ids, params))
            [read] = [
                x for x in ray.get(d.reads.remote()) if x["remote"] == params["remote_request_id"]
            ]
            got = {"hand-off": handoff, "transfer": read["seconds"]}
            got["D prefills"], _ = ray.get(d.generate.remote(_prompt(n, seed + 1), None))
            ray.get(pe.generate.remote(_prompt(n, seed + 2), None))  # writes its KV files
            got["Example"], _ = ray.get(de.generate.remote(_prompt(n, seed + 2), None))  # loads
            if pn is not None:
                try:
                    ids = _prompt(n, seed + 3)
                    _, params = ray.get(pn.generate.remote(ids, {"do_remote_decode": True}))
                    got["NIXL"], _ = ray.get(dn.generate.remote(ids, params), timeout=300)
                    xfers = ray.get(dn.nixl_reads.remote())
                except Exception as exc:  # the other rows go on; say what failed
                    print(f"NixlConnector's hand-off failed ({n} tokens): {_why(exc)}")
                    pn = dn = None
                    xfers = []
                if xfers:  # one per request here (TP 1): the sum if more
                    got["NIXL transfer"] = sum(x["seconds"] for x in xfers)
                    nixl_mib = sum(x["bytes"] for x in xfers) / 2**20
            if not cold:
                cold = dict(got)
            if r:
                for row, seconds in got.items():
                    times.setdefault((row, n), []).append(seconds)
                mib = read["bytes"] / 2**20
    print("first hand-off, ms: " + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in cold.items()))
    moved = f"{mib:.0f} MiB of KV" + (f", NIXL {nixl_mib:.0f} MiB" if nixl_mib else "")
    print(f"medians over {rounds} rounds, ms ({SIZES[-1]} tokens: raydirect read {moved})")
    print(f"{'row':<14}" + "".join(f"{n:>10}" for n in SIZES))
    for row in ROWS:
        if (row, SIZES[0]) not in times:
            continue
        cells = "".join(
            f"{1e3 * statistics.median(times[(row, n)]):>10.1f}"
            if (row, n) in times
            else f"{'-':>10}"
            for n in SIZES
        )
        print(f"{row:<14}{cells}")
    for ours, theirs in (("hand-off", "NIXL"), ("transfer", "NIXL transfer")):
        if all((theirs, n) in times for n in SIZES):
            ratios = [
                statistics.median(times[(ours, n)]) / statistics.median(times[(theirs, n)])
                for n in SIZES
            ]
            cells = "".join(f"{x:>10.2f}" for x in ratios)
            verdict = "met" if max(ratios) <= 0.6 else "not met"
            print(f"{ours + ' / NIXL':<14}{cells}   (target <= 0.6: {verdict})")
    time.sleep(2.0)  # let the engines settle after the last round (measuring idle)
    holders = [("raydirect", p, d)] + ([("NIXL", pn, dn)] if pn is not None else [])
    for name, prefill, decode in holders:
        idle = _cpu_share(prefill, 2.0)
        _, params = ray.get(prefill.generate.remote(_prompt(512, 999), {"do_remote_decode": True}))
        holding = _cpu_share(prefill, 2.0)
        ray.get(decode.generate.remote(_prompt(512, 999), params))  # read: P frees them
        print(f"{name} P's core + worker, cores used: idle {idle:.2f}, holding {holding:.2f}")
    _busy_threads(
        {k: e for k, e in engines.items() if pn is not None or k not in ("pn", "dn")}, 2.0
    )


NAMES = {
    "p": "raydirect P",
    "d": "raydirect D",
    "pe": "Example P",
    "de": "Example D",
    "pn": "NIXL P",
    "dn": "NIXL D",
}


def _affinity(engines: dict[str, Any]) -> None:
    """Print the CPUs each engine's threads may run on, as they ended up."""
    print("affinity (bound to: P core 0, D core 1), threads' allowed CPUs:")
    for key, engine in engines.items():
        where: dict[str, list[str]] = {}
        for proc, thread, allowed, _ in ray.get(engine.threads.remote()):
            name = thread.split("/")[0]
            where.setdefault(f"{proc} {allowed}", []).append(name)
        cells = "; ".join(
            f"{k}: {len(v)} ({', '.join(sorted(set(v), key=lambda x: (x != 'main', x))[:4])})"
            for k, v in sorted(where.items())
        )
        print(f"  {NAMES[key]:<12} {cells}")


def _busy_threads(engines: dict[str, Any], seconds: float) -> None:
    """The threads of idle engines that use CPU (NIXL's progress threads spin)."""
    before = {k: ray.get(e.threads.remote()) for k, e in engines.items()}
    time.sleep(seconds)  # measuring, not synchronising
    for key, engine in engines.items():
        used = {(pr, t): u for pr, t, _, u in before[key]}
        busy = [
            f"{pr} {t} [{a}] {(u - used[(pr, t)]) / seconds:.2f}"
            for pr, t, a, u in ray.get(engine.threads.remote())
            if (pr, t) in used and u - used[(pr, t)] >= 0.05 * seconds
        ]
        print(f"{NAMES[key]} idle, threads using >= 5% of a core: {', '.join(busy) or 'none'}")


if __name__ == "__main__":
    main()
