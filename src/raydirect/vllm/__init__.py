"""raydirect inside vLLM: the weight-transfer backend ``"raydirect"`` and the KV
connector ``"RaydirectConnector"``.

Turn it on with ``LLM(..., weight_transfer_config={"backend": "raydirect"})`` (or
``--weight-transfer-config '{"backend": "raydirect"}'``); on the trainer,
``WeightTransferTrainerFactory.trainer_init(RaydirectTrainerInitInfo(rank=r),
client=..., source=...)`` then ``send_weights()`` once per step. vLLM finds the
backend through the ``vllm.general_plugins`` entry point in every process it
starts; importing this package registers it too. See docs/vllm.md.

Registration comes first and each part stands alone: where a vLLM outside the
supported range lacks what the weight backend needs, the KV connector still
registers (and the other way round), and the missing names say why.

A client of raydirect's public API only (an import-linter contract says so).
"""

from typing import Any

from raydirect.vllm.plugin import register

__all__ = [
    "ParamMetas",
    "RaydirectTrainerInitInfo",
    "RaydirectTrainerWeightTransferEngine",
    "RaydirectWeightTransferEngine",
    "ShardedModuleSource",
    "register",
]

register()

_missing: dict[str, str] = {}
try:
    from raydirect.vllm.sources import ParamMetas, ShardedModuleSource
    from raydirect.vllm.trainer import (
        RaydirectTrainerInitInfo,
        RaydirectTrainerWeightTransferEngine,
    )
except (ImportError, TypeError, AttributeError) as exc:  # this vLLM's weight-transfer API
    for _name in ("ParamMetas", "ShardedModuleSource", "RaydirectTrainerInitInfo"):
        _missing[_name] = f"{type(exc).__name__}: {exc}"
    _missing["RaydirectTrainerWeightTransferEngine"] = _missing["RaydirectTrainerInitInfo"]
try:
    from raydirect.vllm.worker import RaydirectWeightTransferEngine
except (ImportError, TypeError, AttributeError) as exc:  # vLLM internals the worker loads through
    _missing["RaydirectWeightTransferEngine"] = f"{type(exc).__name__}: {exc}"


def __getattr__(name: str) -> Any:
    if name in _missing:
        raise ImportError(f"raydirect.vllm.{name} is not available here: {_missing[name]}")
    raise AttributeError(f"module 'raydirect.vllm' has no attribute {name!r}")
