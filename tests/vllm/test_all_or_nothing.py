"""All or nothing, across every worker of every engine, against real vLLM engines:
a refusal by any worker of any engine leaves every engine serving what it had
(log-probs equal Hugging Face's on the previous weights, weight version
unchanged, no vLLM update session left open), the next update from a new trainer
lands, nothing reads the trainer's tensors once ``send_weights`` has raised, a
hung engine is named within the deadline, and an engine restarted between
updates takes the next one.

Two engines of their own: a tensor-parallel-2 one on the tiny Llama and a
tensor-parallel-1 one on a tied-embeddings Llama (it accepts an update without
``lm_head.weight``, which the other refuses)."""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch
from ray import cloudpickle
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
    save_llama,
    start_engine,
    state_of,
)

import raydirect as rd
from raydirect.vllm import RaydirectTrainerInitInfo, clients

from helpers import wait_for

# Ray's workers cannot import the tests directory: the impostor actor goes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
IDS = prompt(24, 7)
TIED = {"tie_word_embeddings": True}
DOWN = "model.layers.1.mlp.down_proj.weight"  # row-parallel: cut along dim 1 at TP 2


@pytest.fixture(scope="module")
def tied(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    path = tmp_path_factory.mktemp("tied-llama")
    save_llama(path, seed=0, **TIED)
    actor = start_engine(path, restarts=1, weight_transfer_config={"backend": "raydirect"})
    yield actor
    ray.kill(actor, no_restart=True)


def _trainer(
    engines: list[Any], source: WeightSource, timeout: float = 120, name: str = "raydirect-vllm"
) -> Any:
    return WeightTransferTrainerFactory.trainer_init(
        RaydirectTrainerInitInfo(rank=0, timeout=timeout, name=name),
        client=RayVLLMWeightSyncClient(engines),
        source=source,
    )


def _serves(engine: Any, state: dict[str, torch.Tensor], **config: Any) -> float:
    got = ray.get(engine.prompt_logprobs.remote(IDS), timeout=120)
    return max_difference(got, hf_prompt_logprobs(state, IDS, **config))


def _tied_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with its head its embedding (a copy of it), as a tied model's."""
    return {**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()}


def _sessions_open(engine: Any) -> list[bool]:
    def read(worker: Any) -> bool:
        return bool(worker._weight_update_active)

    return ray.get(engine.collective_rpc.remote(read), timeout=60)


def _version(engine: Any) -> str:
    return ray.get(engine.get_weight_version.remote(), timeout=60)


def _stepped(model: torch.nn.Module, by: float) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(by)
    return state_of(model)


@pytest.mark.parametrize("columns", [8, -8], ids=["wider", "narrower"])
def test_a_tensor_of_the_wrong_global_shape_is_refused_by_every_worker(
    tp2_engine: Any, columns: int
) -> None:
    """Only the last tensor-parallel worker's slice sees the end of the cut: the
    refusal is still the whole engine's, both workers keep the previous weights."""
    good = random_llama(seed=51)
    trainer = _trainer([tp2_engine], ModuleSource(good))
    trainer.send_weights()
    before = _stepped(good, 1.01)
    trainer.send_weights()
    assert _version(tp2_engine) == "2"
    bent = _stepped(good, 1.5)
    bent[DOWN] = torch.randn(bent[DOWN].shape[0], bent[DOWN].shape[1] + columns)
    bad = _trainer([tp2_engine], DictSource(bent))
    with pytest.raises(rd.WeightSyncError, match="down_proj") as info:
        bad.send_weights()
    assert "was not applied" in str(info.value) and "keep serving" in str(info.value)
    assert _serves(tp2_engine, before) < LOGPROB_TOLERANCE  # both workers: the previous weights
    assert _version(tp2_engine) == "2"
    assert _sessions_open(tp2_engine) == [False, False]
    fresh = random_llama(seed=52)
    _trainer([tp2_engine], ModuleSource(fresh)).send_weights()  # a new trainer's update lands
    assert _serves(tp2_engine, state_of(fresh)) < LOGPROB_TOLERANCE
    assert _version(tp2_engine) == "1"


def test_one_refusing_engine_and_nothing_read_after_the_raise(tp2_engine: Any, tied: Any) -> None:
    """Two engines in one client, on a trainer whose head is its embedding: the
    untied engine refuses an update without ``lm_head.weight`` at once, the tied
    one would take it and is still reading then. Neither applies it; once
    ``send_weights`` has raised no engine reads the trainer's tensors (they are
    written in place right after); the next update to both lands."""
    model = random_llama(seed=53, **TIED)
    _trainer([tp2_engine, tied], DictSource(_tied_state(state_of(model)))).send_weights()
    before = _tied_state(state_of(model))
    assert _serves(tp2_engine, before) < LOGPROB_TOLERANCE
    assert _serves(tied, before, **TIED) < LOGPROB_TOLERANCE
    headless = {k: v for k, v in _stepped(model, 1.3).items() if k != "lm_head.weight"}
    bad = _trainer([tp2_engine, tied], DictSource(headless))
    with pytest.raises(rd.WeightSyncError, match="lm_head") as info:
        bad.send_weights()
    assert "keep serving" in str(info.value)
    for tensor in headless.values():  # no object holds them: nothing can read them
        rd.wait_tensor_freed(tensor, timeout=0)
        tensor.fill_(float("nan"))
    assert _serves(tp2_engine, before) < LOGPROB_TOLERANCE
    assert _serves(tied, before, **TIED) < LOGPROB_TOLERANCE
    assert [_version(e) for e in (tp2_engine, tied)] == ["1", "1"]
    assert _sessions_open(tp2_engine) == [False, False] and _sessions_open(tied) == [False]
    after = _tied_state(_stepped(model, 0.9))
    _trainer([tp2_engine, tied], DictSource(after)).send_weights()
    assert _serves(tp2_engine, after) < LOGPROB_TOLERANCE
    assert _serves(tied, after, **TIED) < LOGPROB_TOLERANCE


def test_a_session_left_open_by_a_dead_trainer_is_closed(tp2_engine: Any) -> None:
    """A trainer that opened the engine's update session and died: vLLM would
    refuse every later start. A new trainer's init closes it."""
    RayVLLMWeightSyncClient([tp2_engine]).start_weight_update()  # ... and its trainer is gone
    assert _sessions_open(tp2_engine) == [True, True]
    model = random_llama(seed=54)
    _trainer([tp2_engine], ModuleSource(model)).send_weights()
    assert _serves(tp2_engine, state_of(model)) < LOGPROB_TOLERANCE
    assert _sessions_open(tp2_engine) == [False, False]


def test_a_name_no_rank_published_is_refused(tied: Any) -> None:
    model = random_llama(seed=55, **TIED)
    trainer = _trainer([tied], ModuleSource(model))
    trainer.send_weights()
    before = state_of(model)
    norm = "model.norm.weight"
    bad = _trainer([tied], DictSource(_stepped(model, 2.0), unpublished=(norm,)))
    with pytest.raises(rd.WeightSyncError, match=f"{norm}.*no trainer rank published"):
        bad.send_weights()
    assert _serves(tied, _tied_state(before), **TIED) < LOGPROB_TOLERANCE
    # A name the source stops yielding is not published again from an earlier step.
    state = _tied_state(state_of(model))
    shrinking = _trainer([tied], DictSource(state))
    shrinking.send_weights()
    del state[norm]
    with pytest.raises(rd.WeightSyncError, match=f"{norm}' is filled by no published tensor"):
        shrinking.send_weights()


def test_a_casting_dtype_is_accepted_and_exact(tied: Any) -> None:
    """float64 trainer tensors into a float32 engine: vLLM's loaders cast, so does
    the update (those layers go through their loaders)."""
    model = random_llama(seed=56, **TIED)
    state = {k: v.double() for k, v in state_of(model).items()}
    _trainer([tied], DictSource(state)).send_weights()
    want = {k: v.float() for k, v in state.items()}
    assert _serves(tied, _tied_state(want), **TIED) < LOGPROB_TOLERANCE


def test_a_hung_engine_is_named_within_the_deadline(tied: Any) -> None:
    """An engine busy in a long call does not answer the update: ``send_weights``
    raises within its timeout naming the call, and the engine takes the next one."""

    def busy(worker: Any) -> None:
        import time

        time.sleep(12)

    model = random_llama(seed=57, **TIED)
    trainer = _trainer([tied], ModuleSource(model), timeout=6)
    trainer.send_weights()
    hold = tied.collective_rpc.remote(busy)
    started = time.monotonic()
    with pytest.raises(rd.WeightSyncError, match="start_weight_update call did not return"):
        trainer.send_weights()
    assert time.monotonic() - started < 6 + 2.0
    ray.get(hold, timeout=60)
    wait_for(lambda: _sessions_open(tied) == [False], timeout=60, what="the session closed")
    after = _stepped(model, 1.1)
    trainer.send_weights()  # the same trainer: it initialises the engine again first
    assert _serves(tied, _tied_state(after), **TIED) < LOGPROB_TOLERANCE


def test_an_engine_restarted_between_updates_takes_the_next(tied: Any) -> None:
    model = random_llama(seed=58, **TIED)
    trainer = _trainer([tied], ModuleSource(model))
    trainer.send_weights()
    before = ray.get(tied.pid.remote())
    ray.kill(tied, no_restart=False)  # Ray starts it again: a new engine, no init
    # ray.kill returns before the kill lands: the old engine may still answer
    wait_for(
        lambda: _pid_or_none(tied) not in (None, before), timeout=300, what="the engine restarted"
    )
    after = _stepped(model, 1.2)
    trainer.send_weights()
    assert _serves(tied, _tied_state(after), **TIED) < LOGPROB_TOLERANCE


def _refusal(attempt: Any) -> str:
    try:
        attempt()
    except rd.WeightSyncError as exc:
        return str(exc)
    return "not refused"


def _refusals_during_update(first: Any, *attempts: Any, at: str = "update_weights") -> list[str]:
    """Runs ``first``'s next update and makes each attempt at one point of it:
    right after its call ``at`` returned (its vLLM session open), or for
    ``finish_weight_update`` right before that call (decided, the session still
    open); returns what each attempt was refused with. Rank 0 sends an update
    to a Ray client's engines one by one (``raydirect.vllm.clients``): that is
    where an update is caught."""
    client, said = first._round.client, []
    owner = clients if at == "update_weights" else client
    name = "update_each" if at == "update_weights" else at
    call = getattr(owner, name)

    def overlapped(*args: Any) -> None:
        if at != "finish_weight_update":
            call(*args)
        said.extend(_refusal(attempt) for attempt in attempts)
        if at == "finish_weight_update":
            call(*args)

    setattr(owner, name, overlapped)
    try:
        first.send_weights()
    finally:
        setattr(owner, name, call)
    return said


def test_a_second_trainer_overlapping_the_first_is_refused(tied: Any) -> None:
    """While the first trainer's update is in phase one (its vLLM session open), a
    second trainer's update and a third one's init are refused, naming the
    overlap, and the first's update lands. Before, the second's finish (or the
    third's init) ended the first's session: the first waited out its deadline,
    then said its engine held a mix under the new version, which it never loaded."""
    first_model, second_model = random_llama(seed=63, **TIED), random_llama(seed=64, **TIED)
    first = _trainer([tied], ModuleSource(first_model), timeout=60)
    second = _trainer([tied], ModuleSource(second_model), timeout=60, name="second")
    first.send_weights()
    after = _tied_state(_stepped(first_model, 1.1))
    said = _refusals_during_update(
        first,
        second.send_weights,
        lambda: _trainer([tied], ModuleSource(second_model), name="third"),
    )
    assert len(said) == 2 and all("must not overlap" in s for s in said), said
    assert _serves(tied, after, **TIED) < LOGPROB_TOLERANCE
    assert _version(tied) == "2" and _sessions_open(tied) == [False]
    second.send_weights()  # once the first's update has ended, the second's lands
    assert _serves(tied, _tied_state(state_of(second_model)), **TIED) < LOGPROB_TOLERANCE


def _applied(engine: Any) -> list[Any]:
    """The version each worker of ``engine`` last applied."""

    def read(worker: Any) -> Any:
        return worker.weight_transfer_engine.last_update.get("version")

    return ray.get(engine.collective_rpc.remote(read), timeout=60)


@pytest.mark.parametrize(
    "at",
    ["start_weight_update", "update_weights", "finish_weight_update"],
    ids=["after-its-start", "in-phase-one", "before-its-finish"],
)
def test_a_second_trainer_overlapping_the_first_on_a_tp2_engine_is_refused(
    tp2_engine: Any, at: str
) -> None:
    """The overlap above on a tensor-parallel-2 engine, where a call that both
    workers refuse leaves the second worker's reply queued in vLLM's executor
    (every later call then reads the previous one's replies), at each point of
    the first's update: the first's update lands, the second's is refused naming
    the overlap, and the second's next update lands on both workers. Before, an
    init right after the first's start, or between its decision and its finish,
    closed the first's session, and the first's next call failed on both
    workers."""
    first_model, second_model = random_llama(seed=68), random_llama(seed=69)
    first = _trainer([tp2_engine], ModuleSource(first_model), timeout=60)
    second = _trainer([tp2_engine], ModuleSource(second_model), timeout=60, name="second-tp2")
    first.send_weights()
    after = _stepped(first_model, 1.1)
    said = _refusals_during_update(first, second.send_weights, at=at)
    assert len(said) == 1 and "must not overlap" in said[0], said
    assert _serves(tp2_engine, after) < LOGPROB_TOLERANCE
    assert _version(tp2_engine) == "2" and _sessions_open(tp2_engine) == [False, False]
    second.send_weights()  # once the first's update has ended, the second's lands
    assert _applied(tp2_engine) == [2, 2]  # its version 1 was the refused one
    assert _serves(tp2_engine, state_of(second_model)) < LOGPROB_TOLERANCE


def _init_together(trainers: list[Any]) -> None:
    """Holds each trainer's next init until every one of them is about to make it,
    then lets them all go: their updates start at the same moment."""
    meet = threading.Barrier(len(trainers))
    for trainer in trainers:
        client = trainer._round.client
        call = client.init_weight_transfer_engine

        def together(*args: Any, _client: Any = client, _call: Any = call) -> Any:
            _client.init_weight_transfer_engine = _call  # once
            meet.wait(timeout=60)
            return _call(*args)

        client.init_weight_transfer_engine = together


def test_two_trainers_starting_at_once_on_a_tp2_engine(tp2_engine: Any) -> None:
    """Two trainers' updates of one tensor-parallel-2 engine, their inits made at
    the same moment: whichever vLLM runs second finds the other's update under
    way and is refused on both workers alike, naming the overlap; the other lands
    on both workers, no session is left open, and the refused trainer's next
    update lands."""
    models = [random_llama(seed=70), random_llama(seed=71)]
    trainers = [
        _trainer([tp2_engine], ModuleSource(m), timeout=60, name=f"at-once-{k}")
        for k, m in enumerate(models)
    ]
    said: dict[int, str] = {}
    _init_together(trainers)

    def update(k: int) -> None:
        said[k] = _refusal(trainers[k].send_weights)

    threads = [threading.Thread(target=update, args=(k,)) for k in range(len(trainers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(said) == [0, 1], said
    landed = [k for k, s in said.items() if s == "not refused"]
    assert len(landed) == 1, said
    refused = 1 - landed[0]
    assert "must not overlap" in said[refused], said
    assert _serves(tp2_engine, state_of(models[landed[0]])) < LOGPROB_TOLERANCE
    assert _sessions_open(tp2_engine) == [False, False]
    trainers[refused].send_weights()
    assert _applied(tp2_engine) == [2, 2]  # its version 1 was the refused one
    assert _serves(tp2_engine, state_of(models[refused])) < LOGPROB_TOLERANCE


def test_a_trainer_refused_on_one_engine_closes_the_sessions_it_opened_on_others(
    engine: Any, tied: Any
) -> None:
    """A second trainer on two tensor-parallel-1 engines (it starts without an
    init first) while the first's update is open on one of them: its start opens
    a session on the other engine and is refused on the first's. It closes the
    session it opened before it raises. Before, that session stayed open until
    the second's next init, and every other trainer's start there was refused as
    overlapping."""
    other_state = state_of(random_llama(seed=66))
    other = _trainer([engine], DictSource(other_state), timeout=60, name="other")
    other.send_weights()
    second_model, first_model = random_llama(seed=67, **TIED), random_llama(seed=65, **TIED)
    second_state = _tied_state(state_of(second_model))
    second = _trainer(
        [engine, tied], DictSource(second_state), timeout=60, name="refused-elsewhere"
    )
    second.send_weights()
    first = _trainer([tied], ModuleSource(first_model), timeout=60)
    after = _tied_state(_stepped(first_model, 1.1))
    said = _refusals_during_update(first, second.send_weights)
    assert len(said) == 1 and "must not overlap" in said[0], said
    assert _sessions_open(engine) == [False]  # closed before the second raised
    assert _serves(tied, after, **TIED) < LOGPROB_TOLERANCE and _version(tied) == "1"
    assert _serves(engine, second_state) < LOGPROB_TOLERANCE
    for tensor in other_state.values():
        tensor.mul_(0.9)
    other.send_weights()  # another trainer's start on the second's other engine
    assert _serves(engine, other_state) < LOGPROB_TOLERANCE


def _pid_or_none(engine: Any) -> int | None:
    try:
        return ray.get(engine.pid.remote(), timeout=10)
    except (ray.exceptions.RayError, TimeoutError):
        return None


# ---------------------------------------------------------------- the control path


class _Bomb:
    """Unpickling one writes a file: what an impostor's reply would do in a worker."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (open, (self.marker, "w"))


@ray.remote(num_cpus=0)
class Impostor:
    """An actor under a mailbox's name, answering every call with a bomb."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def ranks(self) -> Any:
        return _Bomb(self.marker)

    def take(self, *args: Any) -> Any:
        return _Bomb(self.marker)

    def join(self, *args: Any) -> Any:
        return _Bomb(self.marker)


def _init_info(**changes: Any) -> Any:
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

    context = ray.get_runtime_context()
    info = {
        "name": "raydirect-vllm",
        "namespace": context.namespace,
        "address": context.gcs_address,
        "node": context.get_node_id(),
        "timeout": 30.0,
        **changes,
    }
    return WeightTransferInitRequest(init_info=info)


def _refused(engine: Any, request: Any, said: str) -> None:
    with pytest.raises(ray.exceptions.RayTaskError, match=said):
        ray.get(engine.init_weight_transfer_engine.remote(request), timeout=120)


def _still_updates(engine: Any, seed: int) -> None:
    """A real trainer's update lands: no refused call left a reply queued."""
    model = random_llama(seed=seed)
    _trainer([engine], ModuleSource(model)).send_weights()
    assert _serves(engine, state_of(model)) < LOGPROB_TOLERANCE


def test_a_foreign_cluster_or_namespace_is_refused_before_any_connection(
    tp2_engine: Any,
) -> None:
    with socket.socket() as listener:  # where the foreign init info points
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        foreign = _init_info(address=address, node="ab" * 28)
        _refused(tp2_engine, foreign, "not in this engine's Ray cluster")
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected to it
    _refused(tp2_engine, _init_info(namespace="elsewhere"), "namespace 'elsewhere'")
    _still_updates(tp2_engine, seed=60)


def test_an_impostor_mailbox_never_gets_its_reply_unpickled(tp2_engine: Any, tmp_path: Any) -> None:
    marker = tmp_path / "pwned"
    impostor = Impostor.options(name="impostor").remote(str(marker))  # type: ignore[attr-defined]
    ray.get(impostor.__ray_ready__.remote())
    _refused(tp2_engine, _init_info(name="impostor"), "not a raydirect trainer mailbox")
    # ... nor through an update that carries the init info (an engine that lost its init)
    ray.get(tp2_engine.shutdown_weight_transfer_engine.remote(), timeout=60)
    client = RayVLLMWeightSyncClient([tp2_engine])
    client.start_weight_update()
    update = {"version": 1, "ranks": 1, "names": [], "dtype_names": [], "shapes": []}
    update["trainer"] = _init_info(name="impostor").init_info
    with pytest.raises(ray.exceptions.RayTaskError, match="not a raydirect trainer mailbox"):
        client.update_weights(update)
    with pytest.raises(ray.exceptions.RayTaskError):  # the worker that raised ended its session
        client.finish_weight_update()
    assert not marker.exists()
    ray.kill(impostor)
    _still_updates(tp2_engine, seed=61)


def test_a_failure_inside_the_load_is_reported_as_such(tp2_engine: Any) -> None:
    """Phase two cannot be all or nothing: a worker whose load fails is named, the
    engine is said to hold a mix (not to be untouched), and the next update loads
    every layer again."""
    model = random_llama(seed=62)
    trainer = _trainer([tp2_engine], ModuleSource(model))
    trainer.send_weights()  # the layout is surveyed: the next update only loads
    _stepped(model, 1.1)
    with (
        loads_failing(tp2_engine, rank=1),
        pytest.raises(rd.WeightSyncError, match="committed, but loading it failed") as info,
    ):
        trainer.send_weights()
    said = str(info.value)
    assert "worker 1/2" in said and "a loader bug" in said and "hold a mix" in said, said
    assert "worker 0/2" not in said
    assert _sessions_open(tp2_engine) == [False, False]
    after = _stepped(model, 1.1)
    trainer.send_weights()
    assert _serves(tp2_engine, after) < LOGPROB_TOLERANCE


def test_stray_session_calls_leave_a_tp2_engine_usable(tp2_engine: Any) -> None:
    """vLLM refuses, on every worker, a finish or an update without an update
    session and a start while one is open; its executor read the first worker's
    error and left the second's reply queued, so every later call read the reply
    of the call before: one replayed or retried HTTP call made the engine useless
    until restarted. Now the last worker alone raises vLLM's error: each call is
    refused, the sessions are as they were, and a trainer's next update lands."""
    _still_updates(tp2_engine, seed=63)  # a trainer's init on every worker
    client = RayVLLMWeightSyncClient([tp2_engine])
    with pytest.raises(ray.exceptions.RayTaskError, match="without a matching start"):
        client.finish_weight_update()  # a finish replayed, or retried after it landed
    assert _sessions_open(tp2_engine) == [False, False]  # read before: the finish's error
    with pytest.raises(ray.exceptions.RayTaskError, match="must be called before update_weights"):
        client.update_weights({})
    assert _sessions_open(tp2_engine) == [False, False]
    client.start_weight_update()
    with pytest.raises(ray.exceptions.RayTaskError, match="already active"):
        client.start_weight_update()
    assert _sessions_open(tp2_engine) == [True, True]
    client.finish_weight_update()
    assert _sessions_open(tp2_engine) == [False, False]
    _still_updates(tp2_engine, seed=64)


def test_a_finish_replayed_during_a_tp2_update_leaves_the_engine_usable(tp2_engine: Any) -> None:
    """A finish replayed while a trainer's update is undecided ends its session on
    every worker; the trainer's own finish, after it, was refused on every worker,
    and the engine's replies stayed misaligned (docs/vllm.md said: restart it).
    Now the update is said not to be applied, the version stays, and the next
    update of the same trainer lands."""
    model = random_llama(seed=65)
    trainer = _trainer([tp2_engine], ModuleSource(model))
    trainer.send_weights()
    version = _version(tp2_engine)
    update = clients.update_each  # where rank 0 sends an update

    def replayed(client: Any, info: Any) -> None:
        update(client, info)
        RayVLLMWeightSyncClient([tp2_engine]).finish_weight_update()

    clients.update_each = replayed
    try:
        with pytest.raises(rd.WeightSyncError, match="was not applied"):
            trainer.send_weights()
    finally:
        clients.update_each = update
    assert _version(tp2_engine) == version
    assert _sessions_open(tp2_engine) == [False, False]
    after = _stepped(model, 1.1)
    trainer.send_weights()
    assert _serves(tp2_engine, after) < LOGPROB_TOLERANCE
