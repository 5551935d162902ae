"""What workload 9's two halves share: the driver's (``rdbench.vllm_update``,
``rdbench.vllm_stall``, which import no vLLM) and the engine's and trainers'
processes (``rdbench.vllm_actors``, which do). Importing from here keeps the
driver's modules importable where vLLM is not installed, and the two halves out
of each other's imports. Workload 11 asks here, too, whether vLLM is installed."""

from __future__ import annotations

import importlib.util

DELTA = 0.0625  # the trainer adds this to every parameter before each update

# The request that streams while an update runs (the stall): greedy, its end
# token ignored, long enough to outlast any update (at ~40 ms a token on this
# machine, 1,900 tokens are over a minute; the stream is ended a few tokens
# after the update instead).
STREAM_PROMPT = list(range(1, 65))
MAX_MODEL_LEN = 2048
STREAM_TOKENS = MAX_MODEL_LEN - len(STREAM_PROMPT)


def installed(module: str) -> bool:
    """Whether ``module`` (dotted) can be imported here. A dotted name, such as
    vLLM's engine ``vllm.v1``, tells vLLM itself from a folder that is only named
    ``vllm`` (``tests/vllm`` is a namespace package wherever ``tests`` is on the path)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


VLLM = "vllm.v1"  # a module of vLLM proper: ``installed(VLLM)`` where vLLM is
