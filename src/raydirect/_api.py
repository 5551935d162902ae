"""The public functions: method, put, get, get_async, set_target, wait_tensor_freed,
local_stats."""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, overload

import ray
import torch

from raydirect import _ray
from raydirect._caller_leases import FREED_KW, TOKEN_KW, decorate, ledger
from raydirect._collector import collector_paused
from raydirect._consumer import fetch_value, run_all
from raydirect._device_targets import check_device_fits, on_device, target_device
from raydirect._into import check_disjoint, describe_targets, match, set_hint
from raydirect._lifetime import Lifetime
from raydirect._lifetime import check_transport as check_lifetime_transport
from raydirect._payload import PendingFetch, get_deferred
from raydirect._producer import export
from raydirect._producer import put as put_payload
from raydirect._split import join, split
from raydirect._store import LocalStats, store
from raydirect._tensors import as_tensor
from raydirect._timeouts import checked_timeout
from raydirect.errors import FetchTimeoutError, RaydirectError
from raydirect.transports.base import WriteGate
from raydirect.transports.registry import AUTO, check_name

F = TypeVar("F", bound=Callable[..., Any])

_ASYNC_THREADS = 4
_async_executor: ThreadPoolExecutor | None = None
_pools_lock = threading.Lock()


def _export_returns(
    wrapper: Any, value: Any, transport: str, lifetime: Lifetime | None, token: Any
) -> Any:
    # Read at call time: @ray.method(num_returns=k) may be stacked above us.
    num_returns = _ray.declared_num_returns(wrapper)
    if isinstance(num_returns, int) and num_returns > 1:
        if not isinstance(value, Sequence) or len(value) != num_returns:
            raise ValueError(
                f"{wrapper.__qualname__} declares num_returns={num_returns} but returned "
                f"{type(value).__name__}; return a tuple of {num_returns} values"
            )
        return tuple(export(v, transport, lifetime=lifetime) for v in value)
    claim = None if token is None else functools.partial(ledger.claim, token)
    return export(value, transport, lifetime=lifetime, caller_lease=claim)


@overload
def method(fn: F, /) -> F: ...
@overload
def method(
    *, tensor_transport: str = AUTO, reads: int | None = None, ttl: float | None = None
) -> Callable[[F], F]: ...
def method(
    fn: Any = None,
    /,
    *,
    tensor_transport: str = AUTO,
    reads: int | None = None,
    ttl: float | None = None,
) -> Any:
    """Decorate an actor method so the tensors it returns stay in the actor.

    Use bare (``@rd.method``) or with a transport
    (``@rd.method(tensor_transport="shm")``). Works for sync, threaded and
    async actors, and under or over
    ``@ray.method(num_returns=k)`` (each return becomes its own object). The
    transport name is checked at each call, so it may be registered later.

    An object lives until no ref to it is left anywhere, unless ``reads=N``
    and/or ``ttl=seconds`` state a cheaper lifetime (no lease): freed after its
    N-th read or ``ttl`` s after it is made, whichever comes first, refs or not;
    a later read raises ``rd.ProducerLostError`` naming it (docs/concepts.md).
    """
    lifetime = _lifetime_of(reads, ttl, tensor_transport)
    if fn is None:
        return functools.partial(method, tensor_transport=tensor_transport, reads=reads, ttl=ttl)
    if not callable(fn):
        raise TypeError(
            f"rd.method decorates a method, got {type(fn).__name__}; write @rd.method or "
            '@rd.method(tensor_transport="...")'
        )
    if not isinstance(tensor_transport, str):
        raise TypeError(f"tensor_transport must be a transport name, got {tensor_transport!r}")
    transport = tensor_transport

    if inspect.isasyncgenfunction(fn) or inspect.isgeneratorfunction(fn):
        # Ray 2.60 can lose the count of refs nested in objects a streaming
        # generator yields (ray-project/ray#58080; fix in PR #58082, open): the
        # lease would not hold and the producer could free tensors before a read.
        raise TypeError(
            f"rd.method does not support generator methods yet ({fn.__qualname__}): Ray can "
            "lose refs nested in yielded objects (ray-project/ray#58080). Return a list of "
            "values instead (with @ray.method(num_returns=k), each its own object)"
        )
    return _wrapped(fn, transport, lifetime)


def _wrapped(fn: Any, transport: str, lifetime: Lifetime | None) -> Any:
    """The method Ray sees: ``fn``'s return exported, with ``fn``'s signature and
    Ray options, the caller's lease taken from the hidden keywords."""
    wrapper: Any
    if inspect.iscoroutinefunction(fn):

        async def wrapper(self, *args, **kwargs):
            token = _take_hidden(kwargs)
            value = await fn(self, *args, **kwargs)
            return _export_returns(wrapper, value, transport, lifetime, token)
    else:

        def wrapper(self, *args, **kwargs):
            token = _take_hidden(kwargs)
            return _export_returns(wrapper, fn(self, *args, **kwargs), transport, lifetime, token)

    functools.update_wrapper(wrapper, fn)
    # Ray reads a method's options after inspect.unwrap: without __wrapped__ it
    # sees this wrapper, whose signature and @ray.method attributes match fn's
    # (plus the hidden keywords, which Ray checks each call against).
    del wrapper.__wrapped__
    wrapper.__signature__ = _with_hidden(inspect.signature(fn))
    wrapper.__raydirect_transport__ = transport
    if lifetime is None:  # reads=/ttl= objects take no lease at all
        _ray.set_invocation_decorator(wrapper, decorate)
    return wrapper


def _take_hidden(kwargs: dict[str, Any]) -> Any:
    """Pop what the caller's invocation decorator added: frees to make now, and
    the caller's lease for this call's object (``_caller_leases``)."""
    freed = kwargs.pop(FREED_KW, None)
    if freed is not None:
        ledger.release(freed)
    return kwargs.pop(TOKEN_KW, None)


def _with_hidden(sig: inspect.Signature) -> inspect.Signature:
    params = list(sig.parameters.values())
    at = next((i for i, p in enumerate(params) if p.kind is p.VAR_KEYWORD), len(params))
    hidden = [
        inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=None)
        for k in (TOKEN_KW, FREED_KW)
    ]
    return sig.replace(parameters=params[:at] + hidden + params[at:])


def _lifetime_of(reads: Any, ttl: Any, transport: Any) -> Lifetime | None:
    """``rd.method``'s opt-in lifetime, checked (None: the lease's, by default)."""
    if reads is None and ttl is None:
        return None
    lifetime = Lifetime(reads, ttl)
    if isinstance(transport, str):  # else the TypeError below says what it must be
        check_lifetime_transport(transport)
    return lifetime


def put(value: Any, tensor_transport: str = AUTO) -> ray.ObjectRef:
    """Like ``ray.put``, but ``value``'s tensors stay in this process (actor,
    task or driver) and travel directly to whoever gets the ref."""
    check_name(tensor_transport)
    _ray.ensure_ray()
    return put_payload(value, tensor_transport, _ray.current_task_label() + " rd.put")


def _async_pool() -> ThreadPoolExecutor:
    # Separate from the fetch pool: a get running here waits on fetches there.
    global _async_executor
    with _pools_lock:
        if _async_executor is None:
            _ray.quiet_off_loop_get_warning()
            _async_executor = ThreadPoolExecutor(
                _ASYNC_THREADS, thread_name_prefix=_ray.OFF_LOOP_THREAD_PREFIX
            )
        return _async_executor


def get(
    refs: Any,
    *,
    timeout: float | None = None,
    tensor_transport: str | None = None,
    into: Any = None,
    device: Any = None,
) -> Any:
    """Like ``ray.get``, but every ref's tensors are fetched concurrently, the
    whole call is bounded by ``timeout`` (``FetchTimeoutError``, a
    ``ray.exceptions.GetTimeoutError``), and ``tensor_transport`` can force a
    transport for this read.

    ``into`` receives the tensors into your own memory, for instance a model's
    ``state_dict()``: for one ref, a structure like the value's (or one tensor);
    for a list of refs, a list of those (``None`` where there is none). Every
    target's shape, dtype, device and contiguity are checked before a byte
    moves (``ValueError``/``TypeError`` naming the target), and that no two
    targets share a byte; the returned value holds the target tensors themselves.

    ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"``) allocates every received
    tensor on that device instead, as Ray's ``set_target_device_for_ref`` does:
    a CUDA producer's tensors into this process's host memory, or CPU tensors
    onto a GPU, one copy.
    """
    return _get(refs, timeout, tensor_transport, into, device, None)


def _get(
    refs: Any,
    timeout: float | None,
    tensor_transport: str | None,
    into: Any,
    device: Any,
    gate: WriteGate | None,
) -> Any:
    """``get``; ``gate``: the caller's, closed when it gives up (``get_async``)."""
    timeout = checked_timeout(timeout)
    if tensor_transport is not None:
        check_name(tensor_transport)
    if into is not None and device is not None:
        raise TypeError("rd.get takes into= or device=, not both: into='s tensors are the device")
    dev = target_device(device)
    single = isinstance(refs, ray.ObjectRef)
    ref_list = [refs] if single else _ref_list(refs)
    intos = _per_ref(into, single, len(ref_list))
    deadline = None if timeout is None else time.monotonic() + timeout
    with collector_paused():  # before the values arrive: while the producers export
        described = [describe_targets(target) for target in intos]
    try:
        values = get_deferred(ref_list, timeout)
    except ray.exceptions.GetTimeoutError as exc:  # Ray's: a value not yet returned
        raise FetchTimeoutError(
            f"rd.get timed out after {timeout}s: Ray had not returned every ref's value "
            "(the task or actor method that makes it still running, or queued). Pass a "
            "larger timeout, or check that the producers are alive (`raydirect status`)."
        ) from exc
    pending = [i for i, v in enumerate(values) if isinstance(v, PendingFetch)]
    targets = _checked_targets(values, pending, intos, described)
    if dev is not None:
        for i in pending:
            check_device_fits(values[i].payload.metas, dev)
    try:
        fetched = _fetch_all(
            {i: values[i] for i in pending}, targets, deadline, timeout, tensor_transport, dev, gate
        )
    except RaydirectError as exc:
        _say_partly_written(exc, sorted(targets), single)
        raise
    for i, value in enumerate(values):
        values[i] = fetched[i] if i in fetched else _moved(value, dev)
    return values[0] if single else values


def _say_partly_written(exc: RaydirectError, refs: list[int], single: bool) -> None:
    """Add to a failure midway that ``into=`` targets may hold part of what was
    read (the bytes that arrived before it, the rest as they were)."""
    if not refs or len(exc.args) != 1 or not isinstance(exc.args[0], str):
        return
    whose = "" if single else f" of ref{'s' if len(refs) > 1 else ''} {', '.join(map(str, refs))}"
    exc.args = (
        f"{exc.args[0]} The into= targets{whose} may be partly written (bytes that arrived "
        "before the failure, the others as they were): read the ref into them again",
    )


def _checked_targets(
    values: list[Any], pending: list[int], intos: list[Any], described: list[Any]
) -> dict[int, dict[int, Any]]:
    """Each ref's targets matched against its value, before any transfer starts,
    so a bad target moves nothing."""
    for i, target in enumerate(intos):
        if target is not None and i not in pending:
            raise ValueError(
                f"into= was given for ref {i}, whose value holds no raydirect tensors; "
                "use into= only for objects made by rd.method or rd.put"
            )
    with collector_paused():
        matched = {
            i: match(values[i].payload, intos[i], described[i])
            for i in pending
            if intos[i] is not None
        }
        if len(matched) > 1:  # one ref's targets were checked by match
            check_disjoint({i: (values[i].payload.metas, f) for i, f in matched.items()})
    return dict(matched)


def _moved(value: Any, device: torch.device | None) -> Any:
    """A value that came back through Ray itself (inline, or not raydirect's), its
    tensors on ``device``."""
    if device is None:
        return value
    parts = split(value, only=torch.Tensor)
    if not parts.tensors:
        return value
    return join(parts.skeleton, on_device(parts.originals, parts.metas, device), parts.handles)


def _fetch_all(
    pending: dict[int, PendingFetch],
    targets: dict[int, Any],
    deadline: float | None,
    timeout: float | None,
    forced: str | None,
    device: torch.device | None,
    gate: WriteGate | None,
) -> dict[int, Any]:
    """Every pending fetch at once, bounded by one deadline; the first failure
    wins. Before a failure is raised, the call's gate closes: no fetch of this
    call writes the caller's tensors (or a receive buffer) once it has raised."""
    if len(pending) == 1 and gate is None:  # on this thread: ended when this ends
        [(i, value)] = pending.items()
        try:
            return {i: fetch_value(value.payload, deadline, forced, targets.get(i), device)}
        except TimeoutError as exc:
            raise _timeout_error(timeout, 1, [value]) from exc
    jobs = {
        i: functools.partial(fetch_value, v.payload, deadline, forced, targets.get(i), device)
        for i, v in pending.items()
    }
    outcome = run_all(jobs, deadline, gate)
    if outcome.error is not None:  # the first failure wins, as in ray.get
        raise outcome.error
    if outcome.late:
        late = [pending[i] for i in outcome.late]
        raise _timeout_error(timeout, len(late), late)
    return outcome.results


def _ref_list(refs: Any) -> list[ray.ObjectRef]:
    """``refs``, a list or tuple of ObjectRefs, as a list; ``TypeError`` naming
    what is not one (a value where a ref was meant: Ray hands a method a ref
    given as a direct argument as its value)."""
    if not isinstance(refs, (list, tuple)):
        raise TypeError(
            f"rd.get takes an ObjectRef or a list of them, got {type(refs).__name__}. A ref "
            "passed to a task or actor method as a direct argument arrives as its value; "
            "pass it inside a list ([ref]) to receive the ref itself"
        )
    for i, ref in enumerate(refs):
        if not isinstance(ref, ray.ObjectRef):
            raise TypeError(
                f"rd.get takes ObjectRefs, but refs[{i}] is a {type(ref).__name__}: pass the "
                "refs that .remote() calls and rd.put returned"
            )
    return list(refs)


def _per_ref(into: Any, single: bool, count: int) -> list[Any]:
    if into is None:
        return [None] * count
    if single:
        return [into]
    if not isinstance(into, (list, tuple)) or len(into) != count:
        raise TypeError(
            f"rd.get of {count} refs takes into= as a list of {count} targets "
            "(None where a ref has none)"
        )
    return list(into)


async def get_async(
    refs: Any,
    *,
    timeout: float | None = None,
    tensor_transport: str | None = None,
    into: Any = None,
    device: Any = None,
) -> Any:
    """``rd.get`` for coroutines: ``await rd.get_async(refs)`` fetches on a
    worker thread, so the event loop (and every other coroutine of an async
    actor) keeps running during a large transfer. Same arguments as ``rd.get``."""
    loop = asyncio.get_running_loop()
    gate = WriteGate()
    call = functools.partial(_get, refs, timeout, tensor_transport, into, device, gate)
    try:
        return await loop.run_in_executor(_async_pool(), call)
    except asyncio.CancelledError:
        # The awaiting task gave up (a timeout around it, say): its fetches stop,
        # and nothing of them writes ``into`` once this has raised.
        await loop.run_in_executor(None, gate.close)
        raise


def set_target(ref: ray.ObjectRef, into: Any = None, *, device: Any = None) -> None:
    """Have the next read of ``ref`` in this process land in ``into``, or on
    ``device`` (as for ``rd.get``): Ray rebuilding it as a task argument,
    ``ray.get``, ``rd.get`` or ``await``. Checked now, as ``rd.get`` checks them;
    neither clears the hint. The hint is used once."""
    if into is not None and device is not None:
        raise TypeError("rd.set_target takes into= or device=, not both")
    dev = target_device(device)
    if not isinstance(ref, ray.ObjectRef):
        raise TypeError(f"rd.set_target takes an ObjectRef, got {type(ref).__name__}")
    [value] = get_deferred([ref])
    if not isinstance(value, PendingFetch):
        raise ValueError(
            "rd.set_target: this ref's value holds no raydirect tensors; only objects made "
            "by rd.method or rd.put can be received into your buffers"
        )
    if into is not None:
        match(value.payload, into)
    if dev is not None:
        check_device_fits(value.payload.metas, dev)
    set_hint(value.payload.obj_id, into if dev is None else dev)


def _timeout_error(timeout: float | None, count: int, late: list[Any]) -> FetchTimeoutError:
    who = ", ".join(sorted({p.payload.producer.describe() for p in late}))
    return FetchTimeoutError(
        f"rd.get timed out after {timeout}s: {count} object(s) from {who} had not arrived. "
        "Pass a larger timeout, or check that the producers are alive and reachable "
        "(`raydirect status`)."
    )


def wait_tensor_freed(tensor: Any, timeout: float | None = None) -> None:
    """In a producer: block until no live raydirect object holds ``tensor``, so it
    can be written in place safely. ``TimeoutError`` past ``timeout`` seconds."""
    if as_tensor(tensor) is None:
        raise TypeError(
            "rd.wait_tensor_freed takes one tensor (torch, numpy or JAX), got "
            f"{type(tensor).__name__}: wait on each tensor you will write in place"
        )
    store.wait_tensor_freed(tensor, checked_timeout(timeout))


def local_stats() -> LocalStats:
    """Objects and bytes this process holds as a producer, and transfer counters."""
    return store.stats()


def _forget_after_fork() -> None:
    # A forked child has none of the pool's threads: a submit would wait for ever.
    global _async_executor, _pools_lock
    _async_executor = None
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
