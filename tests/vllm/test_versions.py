"""Robust to vLLM drift (raydirect.vllm.versions, plugin, sessions): each part of
the plug-in registers on its own, a moved vLLM internal fails naming the
supported range, the session guard never turns silently into a no-op; and
staging that does not fit is refused before a byte moves."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

import raydirect as rd
from raydirect.vllm import ParamMetas, plugin, sessions, staging, versions


def test_this_vllm_is_in_the_range() -> None:
    assert versions._release("0.32.0+cpu") == (0, 32)
    assert versions._release("0.33.1") == (0, 33)
    assert versions.outside_range() is None, versions.installed()


def test_a_moved_internal_names_the_range() -> None:
    refused = pytest.raises(ImportError, match=r"needs vLLM >=0\.32,<0\.34.*install a supported")
    with refused, versions.needed_by("raydirect's weight-transfer backend"):
        from vllm.model_executor import no_such_module  # noqa: F401


def test_the_kv_connector_registers_without_the_weight_backend(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A vLLM whose weight-transfer factory refuses the backend still gets the
    KV connector, and the log line names the range."""

    def refused(*args: Any, **kwargs: Any) -> None:
        raise ValueError("this vLLM's factory moved")

    monkeypatch.setattr(WeightTransferEngineFactory, "register_engine", refused)
    monkeypatch.delitem(WeightTransferEngineFactory._registry, plugin.BACKEND)
    monkeypatch.delitem(KVConnectorFactory._registry, plugin.CONNECTOR)
    with caplog.at_level(logging.ERROR):
        failed = plugin.register()
    assert plugin.CONNECTOR in KVConnectorFactory._registry
    assert len(failed) == 1 and "weight-transfer backend" in failed[0], failed
    assert "supports vLLM >=0.32,<0.34" in caplog.text


def test_metadata_serves_both_apis() -> None:
    metas = ParamMetas([])
    assert metas() is metas  # 0.32 calls it, 0.33 reads it


@pytest.mark.parametrize("worker", [None, object()], ids=["no worker", "no session flag"])
def test_the_session_guard_refuses_a_vllm_it_cannot_guard(worker: Any) -> None:
    with pytest.raises(rd.WeightSyncError, match=r"needs vLLM >=0\.32,<0\.34"):
        sessions.guard(worker, last=True)


def test_staging_that_does_not_fit_is_refused_naming_the_fix() -> None:
    free = staging.free_bytes(torch.device("cpu"))
    assert free > 0
    staging.check_room(1, torch.device("cpu"))
    with pytest.raises(rd.WeightSyncError, match="GiB of cpu memory and .* GiB is free"):
        staging.check_room(free * 4, torch.device("cpu"))
