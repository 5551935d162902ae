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
- ``D prefills``: D's ``generate`` of one token of a fresh prompt with no params.

Also P's CPU (its engine core and worker processes) while it holds a request's
blocks for a reader that has not come (vLLM's engine loop keeps stepping), against
P idle.

Needs vLLM: ``.venv-vllm/bin/python benchmarks/kv_handoff.py [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
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
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}


@ray.remote(num_cpus=0)
class Engine:
    def __init__(self, model: str, core: str, kv_transfer_config: dict[str, Any]) -> None:
        os.environ.update(ENV, VLLM_CPU_OMP_THREADS_BIND=core)
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

    def cpu_seconds(self) -> float:
        """CPU seconds the engine's core and worker processes have used."""

        def pid(_worker: Any) -> int:
            return os.getpid()

        [worker] = self.llm.collective_rpc(pid)
        used, stat = 0.0, _stat(worker)
        for fields in (stat, _stat(int(stat[1]))):  # the worker, its parent: the core
            used += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return used

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command (state first: ppid is [1])."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1].split()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _cpu_share(engine: Any, seconds: float) -> float:
    before = ray.get(engine.cpu_seconds.remote())
    time.sleep(seconds)  # measuring, not synchronising
    return (ray.get(engine.cpu_seconds.remote()) - before) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

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
        engines = [
            Engine.remote(model, "0", ours),
            Engine.remote(model, "1", ours),
            Engine.remote(model, "0", example),
            Engine.remote(model, "1", example),
        ]
        try:
            _run(*engines, rounds=args.rounds)
        finally:
            ray.get([e.shutdown.remote() for e in engines])
            shutil.rmtree(files, ignore_errors=True)
    ray.shutdown()


def _run(p: Any, d: Any, pe: Any, de: Any, rounds: int) -> None:
    times: dict[tuple[str, int], list[float]] = {}
    seed = 0
    for n in SIZES:
        for r in range(rounds + 1):  # the first round is the cold one: not counted
            seed += 3
            ids = _prompt(n, seed)
            _, params = ray.get(p.generate.remote(ids, {"do_remote_decode": True}))
            handoff, _ = ray.get(d.generate.remote(ids, params))
            [read] = [
                x for x in ray.get(d.reads.remote()) if x["remote"] == params["remote_request_id"]
            ]
            alone, _ = ray.get(d.generate.remote(_prompt(n, seed + 1), None))
            ray.get(pe.generate.remote(_prompt(n, seed + 2), None))  # writes its KV files
            example, _ = ray.get(de.generate.remote(_prompt(n, seed + 2), None))  # loads them
            if r:
                times.setdefault(("hand-off", n), []).append(handoff)
                times.setdefault(("transfer", n), []).append(read["seconds"])
                times.setdefault(("Example", n), []).append(example)
                times.setdefault(("D prefills", n), []).append(alone)
                mib = read["bytes"] / 2**20
    print(f"medians over {rounds} rounds, ms ({SIZES[-1]} tokens = {mib:.0f} MiB of KV)")
    print(f"{'row':<12}" + "".join(f"{n:>10}" for n in SIZES))
    for row in ("hand-off", "transfer", "Example", "D prefills"):
        cells = "".join(f"{1e3 * statistics.median(times[(row, n)]):>10.1f}" for n in SIZES)
        print(f"{row:<12}{cells}")
    time.sleep(2.0)  # let the engine settle after the last round (measuring idle)
    idle = _cpu_share(p, 2.0)
    _, params = ray.get(p.generate.remote(_prompt(512, 999), {"do_remote_decode": True}))
    holding = _cpu_share(p, 2.0)
    ray.get(d.generate.remote(_prompt(512, 999), params))  # read: P frees them
    print(f"P's core + worker, cores used: idle {idle:.2f}, holding blocks {holding:.2f}")


if __name__ == "__main__":
    main()
