"""The harness the vLLM tests stand on: an engine started on the tiny Llama's saved
weights reports the prompt log-probs Hugging Face's Llama computes on the same
weights. No weight transfer: if this fails, so does every comparison of the
backend's tests, for the harness's sake and not the backend's."""

from __future__ import annotations

import ray
from vllm_harness import (
    LOGPROB_TOLERANCE,
    hf_prompt_logprobs,
    max_difference,
    prompt,
    random_llama,
)


def test_engine_prompt_logprobs_equal_hugging_faces(plain_engine, tiny_llama):
    _, state = tiny_llama
    for seed in (1, 2):
        ids = prompt(24, seed)
        got = ray.get(plain_engine.prompt_logprobs.remote(ids), timeout=120)
        want = hf_prompt_logprobs(state, ids)
        assert len(got) == len(ids) - 1
        assert max_difference(got, want) < LOGPROB_TOLERANCE


def test_other_weights_give_other_logprobs(plain_engine, tiny_llama):
    """The comparison can fail: other weights are far outside the tolerance."""
    ids = prompt(24, 1)
    got = ray.get(plain_engine.prompt_logprobs.remote(ids), timeout=120)
    other = {k: v.detach() for k, v in random_llama(seed=5).state_dict().items()}
    assert max_difference(got, hf_prompt_logprobs(other, ids)) > 100 * LOGPROB_TOLERANCE
