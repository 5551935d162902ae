"""``rd.cluster_secret``: every process of one cluster derives the same secret
for a purpose (two actors and the driver), purposes do not share one, and a
bad purpose is refused before Ray is asked anything."""

from __future__ import annotations

import hashlib
import hmac
import sys

import pytest
import ray
from ray import cloudpickle

import raydirect as rd
from raydirect import _ray, _secrets

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actor runs in workers


@ray.remote(num_cpus=0)
class Signer:
    def secret(self, purpose: str) -> bytes:
        return rd.cluster_secret(purpose)


@pytest.fixture(scope="module")
def signers(ray_session):
    pair = [Signer.remote(), Signer.remote()]
    yield pair
    for s in pair:
        ray.kill(s)


def test_every_process_of_the_cluster_gets_one_secret_per_purpose(signers):
    purposes = ["vllm-kv-handoff", "another"]
    got = [ray.get([s.secret.remote(p) for p in purposes]) for s in signers]
    assert got[0] == got[1]  # two actors, two processes: the same secrets
    assert [rd.cluster_secret(p) for p in purposes] == got[0]  # the driver's too
    handoff, another = got[0]
    assert len(handoff) == len(another) == 32
    assert handoff != another


def test_the_secret_is_the_token_s_hmac_when_ray_authenticates(ray_session):
    token = _ray.cluster_auth_token()
    if token is None:
        pytest.skip("Ray token authentication is off in this session (RAY_AUTH_MODE)")
    want = hmac.new(token, b"raydirect secret v1 vllm-kv-handoff", hashlib.sha256).digest()
    assert rd.cluster_secret("vllm-kv-handoff") == want


def test_without_a_token_the_root_is_a_random_key_made_once_and_kept(ray_session, monkeypatch):
    # The first process's key stays: a later one (its own key new) reads it back.
    first = _ray.cluster_random_key(b"a" * 32)
    assert _ray.cluster_random_key(b"b" * 32) == first
    monkeypatch.setattr(_ray, "cluster_auth_token", lambda: None)
    monkeypatch.setattr(_secrets, "_roots", {})  # as a process of a token-less cluster
    want = hmac.new(first, b"raydirect secret v1 vllm-kv-handoff", hashlib.sha256).digest()
    assert rd.cluster_secret("vllm-kv-handoff") == want


@pytest.mark.parametrize(
    ("purpose", "error"),
    [(b"vllm", TypeError), (None, TypeError), (3, TypeError), ("", ValueError)],
)
def test_a_bad_purpose_is_refused(purpose, error):
    with pytest.raises(error, match="purpose"):
        rd.cluster_secret(purpose)
