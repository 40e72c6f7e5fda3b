"""The ``sglang.srt.plugins`` entry point: SGLang calls ``register()`` in each of its processes.

Off unless ``SGLFAIR_SCHEDULE_POLICY`` is set (``settings.py``): then it registers these hooks
with SGLang's ``HookRegistry`` (applied by SGLang right after plugins load)::

    Scheduler.init_schedule_policy     AFTER   self.policy = FairSchedulePolicy(our policy)
    Scheduler._add_request_to_queue    AROUND  arrival; the policy's refusal → abort with 429
    PrefillAdder.add_one_req           AFTER   charge the admission, place the next choice
    Scheduler.process_batch_result     AFTER   charge output tokens; finishes and aborts
    Scheduler.abort_request            AFTER   queued requests that left the queue
    ScheduleBatch.retract_decode       AFTER   retractions (and requests aborted there)
    Scheduler.get_init_info            AFTER   the plugin's state, in SGLang's /server_info
    Scheduler.get_internal_state       AFTER   its hooks' failures and ledger, at run time
    SchedulerRequestReceiver._pull_raw_reqs               AFTER  the pulling rank's clock tick
    SchedulerRequestReceiver._broadcast_reqs_across_ranks AFTER  every rank takes the tick
    Scheduler.ingest_requests          AFTER   the tick relayed to the next pipeline stage
                                       (clock.py: one clock for all TP ranks and PP stages)

Bad settings stop the scheduler process with one line naming the variable, and so does a
hook SGLang did not apply (``check_hooks``, at install): a server asked to be fair never
silently runs SGLang's own policy instead. Each hook body runs guarded (``hook_errors.py``):
an error in our code is logged and counted, never raised into SGLang's scheduler loop.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any

from sgl_fair.worker.sglang.clock import RANK_CLOCK
from sgl_fair.worker.sglang.profile import profile_path, register_profiler
from sgl_fair.worker.sglang.settings import PluginSettings, settings_from_env

log = logging.getLogger("sgl_fair.sglang")

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
RECEIVER = "sglang.srt.managers.scheduler_components.request_receiver.SchedulerRequestReceiver"
TARGETS = {
    "init_policy": f"{SCHEDULER}.init_schedule_policy",
    "add_request": f"{SCHEDULER}._add_request_to_queue",
    "add_one_req": "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
    "batch_result": f"{SCHEDULER}.process_batch_result",
    "abort": f"{SCHEDULER}.abort_request",
    "retract": "sglang.srt.managers.schedule_batch.ScheduleBatch.retract_decode",
    "init_info": f"{SCHEDULER}.get_init_info",
    "pull": f"{RECEIVER}._pull_raw_reqs",
    "broadcast": f"{RECEIVER}._broadcast_reqs_across_ranks",
    "internal_state": f"{SCHEDULER}.get_internal_state",
    "ingest": f"{SCHEDULER}.ingest_requests",
}

# The key of the plugin's state in what the scheduler reports at start (``get_init_info``),
# which SGLang's /server_info carries: our bridges check it (http_api.plugin_check).
INFO_KEY = "sgl_fair"

_settings: PluginSettings | None = None
_ticks_every_pass = False  # the policy's order reads the clock (PolicyTraits.orders_by_time)


def register() -> None:
    """Entry point (``pyproject.toml``: ``[project.entry-points."sglang.srt.plugins"]``)."""
    global _settings
    try:
        settings = settings_from_env()
    except ValueError as e:
        # SGLang catches Exception from plugins and goes on without them; SystemExit stops it.
        raise SystemExit(f"sgl-fair plugin: {e}") from None
    profile = profile_path()
    if profile is not None:  # times SGLang's admission, the plugin on or off (profile.py)
        register_profiler(profile)
    if settings is None:
        return
    if _settings is not None:
        return  # registered already in this process
    _settings = settings
    global _ticks_every_pass
    _ticks_every_pass = settings.orders_by_time()
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGETS["init_policy"], _after_init_policy, HookType.AFTER)
    HookRegistry.register(TARGETS["add_request"], _around_add_request, HookType.AROUND)
    HookRegistry.register(TARGETS["add_one_req"], _after_add_one_req, HookType.AFTER)
    HookRegistry.register(TARGETS["batch_result"], _after_batch_result, HookType.AFTER)
    HookRegistry.register(TARGETS["abort"], _after_abort, HookType.AFTER)
    HookRegistry.register(TARGETS["retract"], _after_retract, HookType.AFTER)
    HookRegistry.register(TARGETS["init_info"], _after_init_info, HookType.AFTER)
    HookRegistry.register(TARGETS["pull"], _after_pull, HookType.AFTER)
    HookRegistry.register(TARGETS["broadcast"], _after_broadcast, HookType.AFTER)
    HookRegistry.register(TARGETS["internal_state"], _after_internal_state, HookType.AFTER)
    HookRegistry.register(TARGETS["ingest"], _after_ingest, HookType.AFTER)
    # No "on" line here: SGLang configures its logging after loading plugins (install_policy
    # writes it, once the scheduler's log is set up).


def install_policy(scheduler: Any, settings: PluginSettings) -> Any:
    """Replace ``scheduler.policy`` with our policy's ``FairSchedulePolicy``."""
    from sgl_fair.worker.sglang.adapter import FairSchedulePolicy

    mode = disaggregation_mode(scheduler)
    if mode != "null":
        raise SystemExit(
            f"sgl-fair plugin: --disaggregation-mode {mode} is not supported (the fair "
            "policy orders the waiting queue of a plain server); start it without the plugin"
        )
    old = _fair(scheduler)  # ours, from an earlier install: SGLang's own has nothing to detach
    if old is not None:
        old.detach()
    ranks = tp_ranks()
    scheduler.policy = FairSchedulePolicy(
        settings.make_policy(),
        scheduler.tree_cache,
        clock=RANK_CLOCK,  # the same time on every TP rank (clock.py)
        # A shadow only for a policy that asks prefix lengths (else each pass would drain KV
        # events for nothing); only attention-TP rank 0 records KV events (the shadow's
        # feed), so with several ranks every rank matches on its own (identical) tree cache.
        shadow=ranks == 1 and settings.asks_prefix_len(),
        enable_hierarchical_cache=bool(getattr(scheduler, "enable_hierarchical_cache", False)),
        low_priority_first=bool(getattr(scheduler, "schedule_low_priority_values_first", False)),
    )
    scheduler.policy.share = share_preemption(scheduler, scheduler.policy)
    log.info(  # SGLang's log prefix names the rank
        "sgl-fair plugin on: local policy %s, options %s, share guard %s",
        settings.policy,
        json.dumps(settings.opts, sort_keys=True),
        "on" if scheduler.policy.share is not None else "off",
    )
    return scheduler.policy


def share_preemption(scheduler: Any, fair: Any) -> Any:
    """The share guard (``share_preempt.py``) on a server that preempts by priority
    (``--enable-priority-scheduling``: the launcher's default for the policies that share
    running slots, VTC, DLPM and FairServe, and with ``--share-guard on`` for any); else None.
    A policy that orders by class (BROS) sends its own priorities and takes none."""
    from sgl_fair.policies import PolicyTraits
    from sgl_fair.policies.base import PolicyCaps
    from sgl_fair.worker.sglang.share_preempt import SharePreemption

    traits = PolicyTraits.of(type(fair.fair))
    if traits.uses_service_classes:
        return None
    if not getattr(scheduler, "enable_priority_preemption", False):
        return None
    caps = PolicyCaps.of(fair.fair)
    mirror = fair.ledger.mirror
    return SharePreemption(
        lambda req: m.client if (m := mirror(req)) is not None else None,
        threshold=int(getattr(scheduler, "priority_scheduling_preemption_threshold", 10)),
        low_priority_first=bool(getattr(scheduler, "schedule_low_priority_values_first", False)),
        slots=int(getattr(scheduler, "max_running_requests", 0) or 1),
        kv_capacity=int(getattr(scheduler, "max_total_num_tokens", 0) or 1),
        weights=caps.weights,
        service_received=caps.service_received,
        mirror=mirror,
    )


def tp_ranks() -> int:
    """The scheduler's attention tensor-parallel ranks (1 where no config is published)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return max(1, int(getattr(get_parallel(), "attn_tp_size", 1) or 1))
    except (ImportError, ValueError, AttributeError, TypeError, RuntimeError):
        return 1


def pp_stage() -> tuple[int, int]:
    """``(pp_rank, pp_size)`` of this scheduler ((0, 1) where no config is published)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        p = get_parallel()
        return int(getattr(p, "pp_rank", 0) or 0), max(1, int(getattr(p, "pp_size", 1) or 1))
    except (ImportError, ValueError, AttributeError, TypeError, RuntimeError):
        return 0, 1


def _after_pull(result: Any, receiver: Any, *args: Any, **kwargs: Any) -> Any:
    # This rank pulled from the tokenizer: it ticks when it pulled requests (their arrival
    # time), or every iteration for a policy whose order reads the clock. An empty list stays
    # empty otherwise: on TP > 1 SGLang's broadcast of an empty list is one collective, of a
    # tick two, on every scheduler iteration, decode steps included. A later pipeline stage
    # "pulled" what the stage before relayed, its tick with it (_after_ingest): no stamp.
    if isinstance(result, list) and (result or _ticks_every_pass) and pp_stage()[0] == 0:
        RANK_CLOCK.stamp(result)
    return result


def _after_ingest(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    # What a pipeline stage ingested goes on to the next stage (SGLang's PP loops send this
    # list): the tick this stage decides by goes with it (clock.py).
    # Looked up only when there is a new tick to send (pp_stage costs a few µs, and this runs
    # every scheduler iteration, decode steps included).
    if isinstance(result, list) and RANK_CLOCK.has_news():
        rank, size = pp_stage()
        if rank < size - 1:
            RANK_CLOCK.relay(result)
    return result


def _after_broadcast(result: Any, receiver: Any, *args: Any, **kwargs: Any) -> Any:
    return RANK_CLOCK.take(result) if isinstance(result, list) else result


def disaggregation_mode(scheduler: Any) -> str:
    """The server's prefill/decode disaggregation mode (``"null"``: a plain server). SGLang
    0.5.23's ``Scheduler.__init__`` runs ``init_schedule_policy`` (our install) before
    ``init_disaggregation`` sets ``scheduler.disaggregation_mode``, so this reads the
    process's published config (``get_disagg()``), as SGLang itself does at that point."""
    mode = getattr(scheduler, "disaggregation_mode", None)
    if mode is None:
        try:
            from sglang.srt.runtime_context import get_disagg

            mode = get_disagg().disaggregation_mode
        except (ImportError, ValueError, AttributeError, RuntimeError):  # none published
            args = getattr(scheduler, "server_args", None)
            mode = getattr(args, "disaggregation_mode", None)
    mode = getattr(mode, "value", mode)
    return "null" if mode in (None, "null") else str(mode)


def _fair(scheduler: Any) -> Any:
    from sgl_fair.worker.sglang.adapter import FairSchedulePolicy

    policy = getattr(scheduler, "policy", None)
    return policy if isinstance(policy, FairSchedulePolicy) else None


# ---- hooks (signatures follow HookRegistry: AFTER gets the result first, AROUND the original)


def _after_init_policy(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    assert _settings is not None
    check_hooks()
    install_policy(scheduler, _settings)


def check_hooks() -> None:
    """Every target carries our hook (SGLang applied the registry), else stop naming it:
    SGLang only logs a hook it fails to apply, and the plugin would serve on without it."""
    import pkgutil

    hooks = {
        "add_request": _around_add_request, "add_one_req": _after_add_one_req,
        "batch_result": _after_batch_result, "abort": _after_abort, "retract": _after_retract,
        "pull": _after_pull, "broadcast": _after_broadcast, "ingest": _after_ingest,
    }  # fmt: skip
    for key, hook in hooks.items():
        owner, attr = TARGETS[key].rsplit(".", 1)
        try:
            fn = getattr(pkgutil.resolve_name(owner), attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise SystemExit(f"sgl-fair plugin: cannot find {TARGETS[key]}: {e}") from None
        if not carries(fn, hook):
            raise SystemExit(f"sgl-fair plugin: SGLang did not apply our hook on {TARGETS[key]}")


def carries(fn: Any, hook: Any) -> bool:
    """Whether ``fn`` is a HookRegistry wrapper chain with ``hook`` in it (each wrapper holds
    its hook in its closure and the function it wraps as ``__wrapped__``)."""
    seen = 0
    while fn is not None and seen < 64:
        cells = getattr(fn, "__closure__", None) or ()
        if any(_cell(c) is hook for c in cells):
            return True
        fn, seen = getattr(fn, "__wrapped__", None), seen + 1
    return False


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _after_init_info(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """The scheduler's start-up report (SGLang spreads it into /server_info): the plugin's
    policy and options, so a bridge can tell a fair server from a plain one."""
    fair = _fair(scheduler)
    if fair is not None and isinstance(result, dict) and _settings is not None:
        result[INFO_KEY] = {"policy": _settings.policy, "opts": _settings.opts}
    return result


def _around_add_request(original: Any, scheduler: Any, req: Any, *args: Any, **kwargs: Any):
    fair = _fair(scheduler)
    retracted = kwargs.get("is_retracted", args[0] if args else False)
    if fair is None or retracted:
        return original(scheduler, req, *args, **kwargs)
    # On an error the request is queued as SGLang would (the next pass's reconcile adopts it).
    rejection = fair.errors.run("arrival", fair.ledger.arrived, req)
    if rejection is not None:
        reject(scheduler, req, rejection)
        return None
    out = original(scheduler, req, *args, **kwargs)
    fair.errors.run("arrival", _settle_unqueued, fair, scheduler, req)
    return out


def _settle_unqueued(fair: Any, scheduler: Any, req: Any) -> None:
    if not _queued(scheduler.waiting_queue, req):
        fair.ledger.aborted(req, reason="not queued")  # SGLang refused it (queue limit …)


def _queued(queue: Any, req: Any) -> bool:
    """Whether ``req`` is in the waiting queue: O(1) where SGLang appended it (every arrival
    it queues), a scan of the queue only otherwise (an O(queue) scan per arrival is
    O(queue²) for a burst)."""
    return (bool(queue) and queue[-1] is req) or any(r is req for r in queue)


def reject(scheduler: Any, req: Any, rejection: Any) -> None:
    """Answer a request the policy refused: abort it with HTTP 429 (+ when to retry)."""
    from sglang.srt.managers.scheduler import _make_abort_req

    message = f"rejected by the fair scheduler: {rejection.reason}"
    if rejection.retry_after_s is not None:
        message += f" (retry after {rejection.retry_after_s:.1f}s)"
    reason = {
        "type": "abort",
        "status_code": HTTPStatus.TOO_MANY_REQUESTS,
        "message": message,
    }
    scheduler._release_aborted_request(req)
    scheduler.send_abort_output(_make_abort_req(req, finished_reason=reason), req)


def _after_add_one_req(result: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    from sgl_fair.worker.sglang.adapter import adapter_for

    fair = adapter_for(adder.tree_cache)
    if fair is not None and fair.errors.run("add_one_req", fair.after_add_one_req, adder, req,
                                            result, fallback=False) is False:  # fmt: skip
        fair.errors.run("add_one_req", fair.close_walk)  # SGLang's order for the rest


def _after_batch_result(result: Any, scheduler: Any, batch: Any, *args: Any, **kw: Any) -> None:
    fair = _fair(scheduler)
    if fair is not None:
        fair.errors.run("batch_result", fair.after_batch, batch)
        if fair.ledger.dirty:  # aborts since the last pass: settle them once, not per abort
            fair.errors.run("batch_result", fair.ledger.reconcile_waiting, scheduler.waiting_queue)


def _after_abort(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """Queued requests may have left: the ledger settles them at the next batch result or
    pass (one reconcile for a storm of aborts, not one per abort: O(n) each)."""
    fair = _fair(scheduler)
    if fair is not None:
        fair.ledger.dirty = True


def _after_retract(result: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    from sgl_fair.worker.sglang.adapter import adapter_for

    fair = adapter_for(batch.tree_cache)
    if fair is not None and result is not None:
        fair.errors.run("retract", _retracted, fair, result)


def _retracted(fair: Any, result: Any) -> None:
    retracted, _ratio, aborted = result
    fair.after_retract(retracted, aborted)


def _after_internal_state(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang's run-time report of a scheduler (``/server_info``'s ``internal_states``): the
    plugin's policy, its hooks' failures and what its ledger holds."""
    fair = _fair(scheduler)
    state = getattr(result, "internal_state", None)
    if fair is not None and isinstance(state, dict):
        state[INFO_KEY] = fair.report()
    return result
