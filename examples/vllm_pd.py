"""Disaggregated prefill and decode on CPU: two vLLM engines, the KV cache moved
between them by ``RaydirectConnector``.

- the model: a tiny random Llama (written with ``save_pretrained``, nothing
  downloaded), served by two vLLM engines in two Ray actors, both with
  ``kv_transfer_config={"kv_connector": "RaydirectConnector", "kv_role": "kv_both"}``;
- the prefill engine gets each prompt with ``max_tokens=1`` and
  ``kv_transfer_params={"do_remote_decode": True}``, and returns
  ``kv_transfer_params``: its region handle and the request's block ids (JSON,
  what a proxy forwards);
- the decode engine gets the prompt with those params: it reads the prompt's KV
  blocks straight from the prefill engine's memory into its own paged blocks,
  tells it to free them, and generates.

The decode engine's tokens equal those of one engine doing both, and it computed
no prompt token itself (its connector counts the blocks it read).

Needs vLLM (the CPU build here): ``bash scripts/setup-vllm-venv.sh`` and then
``.venv-vllm/bin/python examples/vllm_pd.py``. About a minute, most of it the
engines' start.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import ray
import torch

TINY_LLAMA = {  # head_dim 32: the smallest vLLM's CPU attention takes
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
KV_CONNECTOR = {"kv_connector": "RaydirectConnector", "kv_role": "kv_both"}
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # blocks_read's collective_rpc of a function
}


@ray.remote(num_cpus=0)
class Engine:
    """A vLLM engine with the raydirect KV connector."""

    def __init__(self, model: str, core: str) -> None:
        os.environ.update(VLLM_ENV, VLLM_CPU_OMP_THREADS_BIND=core)
        # vLLM's workers on CPU are processes of this one: the connector joins Ray there
        os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
        from vllm import LLM

        self.llm = LLM(
            model=model,
            dtype="float32",  # bf16 is not supported by every CPU
            skip_tokenizer_init=True,
            max_model_len=128,
            enforce_eager=True,
            block_size=32,
            kv_transfer_config=KV_CONNECTOR,
        )

    def generate(
        self, prompt: list[int], max_tokens: int, kv_transfer_params: dict | None = None
    ) -> tuple[list[int], dict | None]:
        from vllm import SamplingParams

        extra = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra)
        [out] = self.llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        return list(out.outputs[0].token_ids), out.kv_transfer_params

    def blocks_read(self) -> int:
        def read(_worker: Any) -> int:
            from raydirect.vllm import kv_worker

            return sum(r["blocks"] for w in kv_worker.status() for r in w["reads"])

        return sum(self.llm.collective_rpc(read))

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()  # else its core process outlives the actor


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    with tempfile.TemporaryDirectory() as model:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(model)
        prefill, decode = Engine.remote(model, "0"), Engine.remote(model, "1")
        try:
            same = []
            for i, length in enumerate([20, 50, 100]):
                prompt = torch.randint(
                    1, 512, (length,), generator=torch.Generator().manual_seed(i)
                )
                ids = prompt.tolist()
                _, params = ray.get(prefill.generate.remote(ids, 1, {"do_remote_decode": True}))
                params = json.loads(json.dumps(params))  # what a proxy forwards
                tokens, _ = ray.get(decode.generate.remote(ids, 8, params))
                alone, _ = ray.get(prefill.generate.remote(ids, 8))  # one engine, both phases
                same.append(tokens == alone)
                print(
                    f"prompt of {length} tokens: {len(params['remote_block_ids'])} blocks "
                    f"handed over, decode's tokens {tokens}"
                )
            print(f"decode's tokens equal one engine's for every prompt: {all(same)}")
            print(
                f"blocks the decode engine read from the prefill engine: "
                f"{ray.get(decode.blocks_read.remote())}"
            )
        finally:
            ray.get([prefill.shutdown.remote(), decode.shutdown.remote()])
    ray.shutdown()


if __name__ == "__main__":
    main()
