"""Under ``auto``, small values go inline with Ray's reply; larger ones stay direct."""

from __future__ import annotations

import gc
import pickle

import pytest
import ray
import torch
from ray import cloudpickle

from raydirect import _payload
from raydirect._producer import INLINE_ENV, export

import actors
from helpers import wait_for

LIMIT = 64 << 10


@pytest.fixture(scope="module")
def inline_pair(ray_session):
    env = {"runtime_env": {"env_vars": {"RAYDIRECT_INLINE_BYTES": str(LIMIT)}}}
    p = actors.Producer.options(**env).remote()
    c = actors.Consumer.options(**env).remote()
    yield p, c
    ray.kill(p)
    ray.kill(c)


def _held(actor) -> int:
    return ray.get(actor.stats.remote()).num_objects


def _none_held(actor) -> None:
    """Objects of earlier tests are freed once Ray says their refs are gone,
    asynchronously: start from none."""
    wait_for(lambda: _held(actor) == 0, what="objects of earlier tests to be freed")


def test_a_small_value_goes_inline_and_nothing_is_held(inline_pair):
    p, c = inline_pair
    _none_held(p)
    ref = p.value.remote("dtypes")  # about 40 KiB of tensors
    assert ray.get(c.check.remote("dtypes", ref)) is None
    assert actors.check_value("dtypes", ray.get(ref)) is None
    assert _held(p) == 0
    assert ray.get(c.stats.remote()).objects_received == {}


def test_a_value_over_the_limit_stays_in_the_producer(inline_pair):
    p, c = inline_pair
    _none_held(p)
    ref = p.big.remote(LIMIT + 1, 4)
    assert ray.get(c.summarize.remote(ref))[:2] == (LIMIT + 1, 4)
    assert _held(p) == 1
    del ref
    wait_for(lambda: _held(p) == 0, what="the direct object to be freed")


def test_a_named_transport_is_never_inlined(inline_pair):
    p, c = inline_pair
    ref = p.value_tcp.remote("dtypes")
    assert ray.get(c.check.remote("dtypes", ref)) is None
    assert ray.get(c.stats.remote()).objects_received.get("tcp") == 1
    del ref
    _none_held(p)


def test_an_inlined_ref_passed_back_to_its_producer_is_the_same_tensor(inline_pair):
    p, _ = inline_pair
    _none_held(p)
    ref = p.keep.remote("inline", 1000)  # 4 KB: travels inline
    assert _held(p) == 0  # inlined, not held as a direct object
    assert ray.get(p.is_kept.remote("inline", ref)) is True
    # Elsewhere it is a copy of the same values, as for any value.
    assert ray.get(ref).tolist() == list(range(1000))


def test_returning_one_live_tensor_many_times_keeps_one_entry(ray_session, monkeypatch):
    """The review's reproduction: 100,000 inlined returns of one live tensor left
    100,000 entries in a module-level registry. One entry per live tensor."""
    monkeypatch.delenv(INLINE_ENV, raising=False)  # the default limit
    kept = torch.arange(1000, dtype=torch.float32)
    before = _payload.inline_entries()
    for _ in range(100_000):
        value = export({"t": kept}, "auto")
        assert isinstance(value, _payload.InlineValue)
    assert _payload.inline_entries() == before + 1
    # Passed back to this process, it is still the very tensor.
    assert pickle.loads(cloudpickle.dumps(value))["t"] is kept
    del kept, value
    gc.collect()
    assert _payload.inline_entries() == before  # the entry goes with the tensor


def test_an_actor_returning_one_tensor_keeps_one_entry(inline_pair):
    p, _ = inline_pair
    assert ray.get(p.keep_same.remote()).tolist() == list(range(10))
    entries = ray.get(p.inline_entries.remote())
    refs = [p.keep_same.remote() for _ in range(300)]
    assert all(t.tolist() == list(range(10)) for t in ray.get(refs))
    assert ray.get(p.inline_entries.remote()) == entries


@pytest.mark.parametrize(
    "case", ["dtypes", "views", "aliasing", "numpy", "grad_state", "tied", "params"]
)
def test_an_inline_value_travels_as_one_buffer(case):
    # Pickled one by one, torch tensors cost 116 us to pickle and 140 us to
    # unpickle at 64 KiB (torch saves each storage as a file): an inline value's
    # tensors now travel as one buffer, and arrive exactly.
    value = actors.make_value(case)
    inline = export(value, "auto")
    assert isinstance(inline, _payload.InlineValue)
    blob = cloudpickle.dumps(inline)
    assert b"_rebuild_tensor" not in blob and b"_load_from_bytes" not in blob
    rebuild, state = inline.__reduce__()
    state = pickle.loads(cloudpickle.dumps(state))
    got = rebuild(b"another process", *state[1:])  # as another process rebuilds it
    assert actors.check_value(case, got) is None
