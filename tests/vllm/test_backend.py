"""The backend "raydirect" against a real vLLM engine: updates land (the engine's
prompt log-probs equal Hugging Face's on the trainer's weights), repeatedly, with
tensor parallelism each worker reads only its slice, one client drives two
engines, and every refusal names what went wrong and leaves the engine serving."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch
from vllm.distributed.weight_transfer.base import ModuleSource, WeightSource
from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
from vllm_harness import (
    LOGPROB_TOLERANCE,
    DictSource,
    hf_prompt_logprobs,
    loads_failing,
    max_difference,
    prompt,
    random_llama,
    start_engine,
)

import raydirect as rd
from raydirect.vllm import RaydirectTrainerInitInfo, clients

IDS = prompt(24, 3)


def _trainer(engines: list[Any], source: WeightSource, **info: Any) -> Any:
    return WeightTransferTrainerFactory.trainer_init(
        RaydirectTrainerInitInfo(rank=0, timeout=120, **info),
        client=RayVLLMWeightSyncClient(engines),
        source=source,
    )


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _serves(engine: Any, state: dict[str, torch.Tensor]) -> float:
    got = ray.get(engine.prompt_logprobs.remote(IDS), timeout=120)
    return max_difference(got, hf_prompt_logprobs(state, IDS))


def _last_updates(engine: Any) -> list[dict[str, Any]]:
    """Each worker's record of its last update, and its own parameters' bytes as
    they load (on CPU a processed weight is repacked: vLLM's reload metadata holds
    its checkpoint-format shape)."""

    def read(worker: Any) -> dict[str, Any]:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        own = sum(
            t.numel() * t.element_size()
            for m in worker.model_runner.model.modules()
            for t in get_layerwise_info(m).restore_metadata[0].values()
        )
        return {**worker.weight_transfer_engine.last_update, "own": own}

    return ray.get(engine.collective_rpc.remote(read), timeout=60)


def test_repeated_updates_match_hugging_face(engine: Any) -> None:
    model = random_llama(seed=11)
    trainer = _trainer([engine], ModuleSource(model), keep_staging=True)
    for step in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        trainer.send_weights()
        assert _serves(engine, _state(model)) < LOGPROB_TOLERANCE, step
        assert ray.get(engine.get_weight_version.remote()) == str(step + 1)
    [record] = _last_updates(engine)
    assert record["version"] == 3
    # a Llama's loaders only slice and concatenate: every byte lands straight in
    # the tensors vLLM processes, none through a loader's copy
    assert record["landed_bytes"] == record["bytes"] == record["own"], record
    # the engine serves from its own tensors, not from the memory the next
    # update lands in (on CPU a linear layer's oneDNN handle holds its own copy)
    assert sum(ray.get(engine.collective_rpc.remote(_poison_landed()), timeout=60)) > 0
    assert _serves(engine, _state(model)) < LOGPROB_TOLERANCE
    trainer.shutdown()


def _poison_landed() -> Any:
    """A worker function (a closure, so shipped by value) that fills the memory the
    worker lands updates in with NaN and returns its bytes."""

    def poison(worker: Any) -> int:
        poisoned = 0
        for receiver in worker.weight_transfer_engine._receivers.values():
            for tensors in receiver.landed.values():
                for t in tensors.values():
                    t.fill_(float("nan"))
                    poisoned += t.numel() * t.element_size()
        return poisoned

    return poison


def _staging(engine: Any) -> list[tuple[int, int]]:
    """Each worker's staging: the bytes its receivers' memory holds, and what
    ``staging_bytes`` says they allocate (0, 0 where none is kept)."""

    def staged(worker: Any) -> tuple[int, int]:
        from raydirect.vllm.staging import staging_bytes

        wte = worker.weight_transfer_engine
        held = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for r in wte._receivers.values()
            for t in r.memory()
        }
        said = sum(staging_bytes(p.published, p.survey) for p in wte._plans.values())
        return sum(held.values()), said if wte._receivers else 0

    return ray.get(engine.collective_rpc.remote(staged), timeout=60)


def test_staging_is_kept_unless_freeing_is_asked(engine: Any) -> None:
    """With keep_staging=False a worker's staging goes once the update has loaded
    (the memory is the engine's again); by default it stays for the next update,
    and the check of free memory before phase one counts exactly what it allocates."""
    model = random_llama(seed=14)
    freeing = _trainer([engine], ModuleSource(model), keep_staging=False)
    freeing.send_weights()
    freeing.shutdown()
    assert _staging(engine) == [(0, 0)]
    assert _serves(engine, _state(model)) < LOGPROB_TOLERANCE
    kept = _trainer([engine], ModuleSource(model), name="kept")
    kept.send_weights()
    [(held, said)] = _staging(engine)
    own = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert held == said and 0 < held <= own, (held, said, own)
    kept.send_weights()
    assert _serves(engine, _state(model)) < LOGPROB_TOLERANCE
    kept.shutdown()
    with pytest.raises(TypeError, match="keep_staging is True or False, got 'false'"):
        RaydirectTrainerInitInfo(rank=0, keep_staging="false")  # type: ignore[arg-type]


def test_two_engines_one_client_and_tensor_parallel_slices(engine: Any, tp2_engine: Any) -> None:
    """One client fans out to a plain engine and a tensor-parallel-2 one; each TP
    worker receives its own slice, not the whole model."""
    model = random_llama(seed=12)
    trainer = _trainer([engine, tp2_engine], ModuleSource(model))
    for _ in range(2):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.01)
        trainer.send_weights()
        for e in (engine, tp2_engine):
            assert _serves(e, _state(model)) < LOGPROB_TOLERANCE
    whole = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    workers = _last_updates(tp2_engine)
    assert len(workers) == 2
    for w in workers:
        assert w["bytes"] <= 1.1 * w["own"], w
        assert w["landed_bytes"] == w["bytes"], w  # tensor-parallel slices land too
        assert w["bytes"] < 0.75 * whole, (w, whole)
    trainer.shutdown()


def _versions(engines: tuple[Any, ...]) -> list[str]:
    return ray.get([e.get_weight_version.remote() for e in engines], timeout=60)


def test_after_a_partial_load_each_engine_reports_the_version_it_loaded(
    engine: Any, tp2_engine: Any
) -> None:
    """vLLM's Ray client sets no engine's weight version once one engine's finish
    raised: the engine that loaded the new weights reported the old version. Now
    each engine whose load ran through reports the new one, and the error says
    which engine holds which."""
    model = random_llama(seed=16)
    trainer = _trainer([engine, tp2_engine], ModuleSource(model))
    trainer.send_weights()  # the layouts are surveyed: the next update only loads
    engines = (engine, tp2_engine)
    assert _versions(engines) == ["1", "1"]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    with (
        loads_failing(tp2_engine, rank=1),
        pytest.raises(rd.WeightSyncError, match="committed, but loading it failed") as info,
    ):
        trainer.send_weights()
    said = str(info.value)
    assert "[0] report weight version 2; [1] keep reporting the version they had" in said, said
    assert _versions(engines) == ["2", "1"]
    assert _serves(engine, _state(model)) < LOGPROB_TOLERANCE
    trainer.send_weights()  # the mixed engine loads every layer again
    assert _versions(engines) == ["3", "3"]
    assert _serves(tp2_engine, _state(model)) < LOGPROB_TOLERANCE
    trainer.shutdown()


def _bent(model: torch.nn.Module, how: str) -> dict[str, torch.Tensor]:
    state = _state(model)
    name = "model.layers.1.mlp.down_proj.weight"
    if how == "extra":
        state["model.layers.1.mlp.extra_proj.weight"] = torch.zeros(4, 4)
    elif how == "missing":
        del state[name]
    elif how == "shape":
        state[name] = torch.zeros(state[name].shape[0], state[name].shape[1] + 8)
    elif how == "broadcast":  # the embedding's loader checks the vocabulary dim only
        embed = "model.embed_tokens.weight"
        state[embed] = torch.zeros(state[embed].shape[0], 1)
    return state


@pytest.mark.parametrize(
    ("how", "said"),
    [
        ("extra", "extra_proj"),
        ("missing", "filled by no published tensor"),
        ("shape", "down_proj"),
        # vLLM's reload refused it midway through the load (a bare AssertionError),
        # the engine then held a mix of its old weights and the new ones
        ("broadcast", "embed_tokens.weight.*published with shape \\(512, 1\\).*broadcast"),
    ],
)
def test_a_refused_update_names_it_and_the_engine_keeps_serving(
    engine: Any, how: str, said: str
) -> None:
    good = random_llama(seed=13)
    trainer = _trainer([engine], ModuleSource(good))
    trainer.send_weights()
    before = _state(good)
    bad = _trainer([engine], DictSource(_bent(good, how)))
    with pytest.raises(rd.WeightSyncError, match=said) as info:
        bad.send_weights()
    assert "keep serving" in str(info.value)
    assert _serves(engine, before) < LOGPROB_TOLERANCE  # untouched
    with torch.no_grad():
        for p in good.parameters():
            p.mul_(0.99)
    trainer = _trainer([engine], ModuleSource(good))
    trainer.send_weights()  # the next update succeeds
    assert _serves(engine, _state(good)) < LOGPROB_TOLERANCE
    trainer.shutdown()


def test_a_replayed_update_changes_nothing(engine: Any) -> None:
    """An old version's update info sent again (vLLM's RPC or HTTP carries plain
    JSON anyone may replay) loads nothing: the version is gone."""
    model = random_llama(seed=14)
    trainer = _trainer([engine], ModuleSource(model))
    trainer.send_weights()
    trainer.send_weights()
    served = ray.get(engine.get_weight_version.remote())
    client = RayVLLMWeightSyncClient([engine])
    stale = {
        "version": 1,
        "ranks": 1,
        "names": [m.name for m in ModuleSource(model).metadata()],
        "dtype_names": ["float32"] * len(list(model.parameters())),
        "shapes": [list(p.shape) for p in model.parameters()],
        "trainer": trainer._round.trainer,
    }
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)  # what a replay that loaded would now read
    client.start_weight_update()
    client.update_weights(stale)
    client.finish_weight_update()
    with torch.no_grad():
        for p in model.parameters():
            p.div_(2.0)
    assert _serves(engine, _state(model)) < LOGPROB_TOLERANCE
    assert ray.get(engine.get_weight_version.remote()) == served
    trainer.send_weights()
    trainer.shutdown()


@pytest.fixture(scope="module")
def engine2(ray_session: None, tiny_llama: Any) -> Iterator[Any]:
    actor = start_engine(tiny_llama[0], weight_transfer_config={"backend": "raydirect"})
    yield actor
    ray.kill(actor)


def test_two_engines_on_a_node_take_one_copy_from_the_trainer(engine: Any, engine2: Any) -> None:
    """The first worker on a node to receive a version relays it to the worker of
    the other engine that reads the same: the trainer sends the model once."""

    def settle(worker: Any) -> bool:  # in the worker: its reads counted at the trainer
        import raydirect.testing

        return raydirect.testing.wait_read_counts(30)

    model = random_llama(seed=15)
    whole = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    trainer = _trainer([engine, engine2], ModuleSource(model))
    for _ in range(2):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.01)
        before = sum(rd.local_stats().bytes_sent.values())
        trainer.send_weights()
        for e in (engine, engine2):
            assert _serves(e, _state(model)) < LOGPROB_TOLERANCE
            assert all(ray.get(e.collective_rpc.remote(settle), timeout=60))
        sent = sum(rd.local_stats().bytes_sent.values()) - before
        assert whole <= sent <= 1.05 * whole, (sent, whole)
        relayed = [r["relayed_from"] for e in (engine, engine2) for r in _last_updates(e)]
        assert sorted(relayed) == [0, 1], relayed
    trainer.shutdown()


def test_a_replayed_finish_does_not_stall_the_engine(engine: Any) -> None:
    """A finish replayed (vLLM's RPC or HTTP) while a trainer's update is in phase
    one, undecided: it ends that session without waiting out the decision (the
    engine runs no step meanwhile), and the trainer's update says it was not
    applied, naming why. Before, the trainer waited out its deadline for loads
    that never came, then said the engine held a mix of two versions."""
    model = random_llama(seed=16)
    trainer = _trainer([engine], ModuleSource(model))
    trainer.send_weights()
    took: list[float] = []
    update = clients.update_each  # where rank 0 sends an update

    def replayed(client: Any, info: Any) -> None:
        update(client, info)  # the trainer's session is open, its update undecided
        started = time.monotonic()
        RayVLLMWeightSyncClient([engine]).finish_weight_update()
        took.append(time.monotonic() - started)

    clients.update_each = replayed
    try:
        with pytest.raises(rd.WeightSyncError, match="version 2 was not applied") as raised:
            trainer.send_weights()
    finally:
        clients.update_each = update
    assert took and took[0] < 3.0, took
    said = str(raised.value)
    assert "dropped, not loaded: its update session was closed before" in said, said
    assert "hold a mix" not in said, said
    assert ray.get(engine.get_weight_version.remote(), timeout=60) == "1"
    trainer.send_weights()
    assert _serves(engine, _state(model)) < LOGPROB_TOLERANCE
