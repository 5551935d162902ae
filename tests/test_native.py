"""The optional native helper (``RAYDIRECT_NATIVE=1``): built once here into a
temporary directory (in the background, as a process that asks for it first
does), then the facts it reads must be exactly what torch's own attributes say,
and export, ``into=`` and the weight API give the same results through it, in
real Ray actors. Skipped, with the compiler's reason, where it cannot be built."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import ray
import torch

from raydirect import _native, _payload
from raydirect._into import describe_targets

from actors import Inference, Trainer, make_weights
from helpers import wait_for


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """The helper, built in the background by the first ``facts`` that wants it."""
    where = str(tmp_path_factory.mktemp("native"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(_native.NATIVE_ENV, "1")
        mp.setenv(_native.DIR_ENV, where)
        mp.setattr(_native, "_state", "off")
        mp.setattr(_native, "_module", None)
        many = [torch.ones(2)] * _native.MIN_TENSORS
        assert _native.facts(many) is None  # not built yet: Python reads them meanwhile
        assert _native.status() == "building"
        wait_for(lambda: _native.status() != "building", timeout=300, what="the native build")
        if _native.status() != "ready":
            pytest.skip("the native helper cannot be built here (see the warning logged)")
        yield where


def _mixed(n: int = 80) -> list[torch.Tensor]:
    """Every kind of plain tensor an export meets, each its own: dtypes, ranks,
    views with an offset, transposed (not contiguous), empty, 0-d, with grad,
    written in place."""
    return [_kind(i) for i in range(n)]


def _kind(i: int) -> torch.Tensor:
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10) + i
    make = [
        lambda: base,
        lambda: base.t(),
        lambda: base[2:],
        lambda: torch.zeros(0, 3),
        lambda: torch.tensor(3.5),
        lambda: torch.ones(4, dtype=torch.bfloat16, requires_grad=True),
        lambda: torch.ones(3, 2, dtype=torch.int8),
        lambda: torch.zeros(5, dtype=torch.bool),
        lambda: torch.ones(2, dtype=torch.complex64),
        lambda: torch.ones(7).add_(1).add_(1),
    ]
    return make[i % len(make)]()


def test_facts_are_torch_s_own(native):
    tensors = _mixed()
    facts = _native.facts(tensors)
    assert facts is not None
    assert facts.shapes == [tuple(t.shape) for t in tensors]
    assert facts.dtypes == [t.dtype for t in tensors]
    assert facts.nbytes == [t.nbytes for t in tensors]
    assert facts.versions == [t._version for t in tensors]
    assert facts.addresses.tolist() == [t.data_ptr() for t in tensors]
    flags = [
        _native.CPU * t.is_cpu
        + _native.REQUIRES_GRAD * t.requires_grad
        + _native.CONTIGUOUS * t.is_contiguous()
        for t in tensors
    ]
    assert facts.flags.tolist() == flags


def test_what_python_reads_instead(native, monkeypatch):
    """Too few tensors, a sparse one (no strides), or the helper not asked for:
    None, and the callers read the facts in Python."""
    assert _native.facts(_mixed(_native.MIN_TENSORS - 1)) is None
    assert _native.facts([*_mixed(), torch.eye(3).to_sparse()]) is None
    monkeypatch.setenv(_native.NATIVE_ENV, "0")
    assert _native.facts(_mixed()) is None


def test_export_and_into_describe_the_same_through_it(native, monkeypatch):
    state = {f"w{i}": t for i, t in enumerate(_mixed()) if t.is_contiguous()}
    targets = {k: torch.empty_like(v) for k, v in state.items()}
    fast = _payload.split(state), describe_targets(targets)
    monkeypatch.setenv(_native.NATIVE_ENV, "0")
    slow = _payload.split(state), describe_targets(targets)
    assert list(fast[0].metas) == list(slow[0].metas)
    assert fast[0].metas.pack() == slow[0].metas.pack()
    # what export needs besides, read in the same loop
    assert fast[0].addresses.tolist() == [t.data_ptr() for t in state.values()]
    assert fast[0].versions == [t._version for t in state.values()] and slow[0].versions is None
    for column in ("keys", "shapes", "dtypes", "devices", "addresses"):
        assert list(getattr(fast[1], column)) == list(getattr(slow[1], column)), column
    # a non-contiguous tensor: no addresses from the helper (export packs it)
    assert _payload.split({**state, "t": _kind(1)}).addresses is None
    # targets sharing memory are left to the per-target checks, as in Python
    shared = {**targets, "again": next(iter(targets.values()))}
    monkeypatch.setenv(_native.NATIVE_ENV, "1")
    assert describe_targets(shared) is None


def test_a_build_that_fails_says_why_once_and_python_goes_on(tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    monkeypatch.setenv(_native.NATIVE_ENV, "1")
    monkeypatch.setenv(_native.DIR_ENV, str(blocked))
    monkeypatch.setattr(_native, "_state", "off")
    monkeypatch.setattr(_native, "_module", None)
    with caplog.at_level(logging.WARNING, logger="raydirect"):
        assert _native.facts(_mixed()) is None
        wait_for(lambda: _native.status() == "failed", timeout=60, what="the failed build")
        assert _native.facts(_mixed()) is None
    assert [r.getMessage() for r in caplog.records if "could not be built" in r.getMessage()]


def test_weight_sync_through_it_in_real_actors(native, ray_session):
    """5,000 tensors through the primitives for two steps, and through the weight
    API, in actors that use the helper (it was built: they load it at once)."""
    env = {"env_vars": {_native.NATIVE_ENV: "1", _native.DIR_ENV: native}}
    t = Trainer.options(runtime_env=env).remote(5000)
    r = Inference.options(runtime_env=env).remote(5000)
    want = make_weights(5000)
    for step in range(2):
        assert ray.get(r.get_into.remote([t.weights_dict.remote()])) is True
        got = ray.get(r.state.remote())
        assert all(torch.equal(got[k], v + step * v.is_floating_point()) for k, v in want.items())
        ray.get(t.step.remote(wait_free=True))
    assert ray.get([t.native_status.remote(), r.native_status.remote()]) == ["ready", "ready"]
    assert ray.get(r.load.remote(t.publish.remote(1))) == 1
    got, sent = ray.get(r.state.remote()), ray.get(t.state.remote())
    assert all(torch.equal(got[k], v) for k, v in sent.items())
    ray.kill(t)
    ray.kill(r)


def test_the_command_builds_it_or_says_why(native, tmp_path):
    """``raydirect native``: finds the build (no compile: the fixture built it)
    and says how to use it; where it cannot build, exit 1 and what it needs."""
    cli = [sys.executable, "-m", "raydirect.cli", "native"]
    env = {**os.environ, _native.DIR_ENV: native}
    done = subprocess.run(cli, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "raydirect_native.so" in done.stdout and f"{_native.NATIVE_ENV}=1" in done.stdout
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    env[_native.DIR_ENV] = str(blocked)
    done = subprocess.run(cli, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1
    assert "the build failed" in done.stderr and "C++ compiler" in done.stderr
