"""SGLang's ``Req`` as our policies see it: the ``Request`` mirror of one of SGLang's
requests, as our bridge sent it (client in ``routing_key``; RT/BE class in ``priority``; an
RT request's SLOs, a FairServe call's interaction, a router replica's dispatch tag and the
router's count of the client's calls in flight in ``sampling_params.custom_params``).
Never raises on what a request carries: the plugin runs inside SGLang's scheduler."""

from __future__ import annotations

from typing import Any

from sgl_fair.request import (
    CALL_PARAM,
    DEFAULT_CLIENT,
    INFLIGHT_PARAM,
    SLO_PARAM,
    TAG_PARAM,
    Request,
    ServiceClass,
    apply_call_params,
    inflight_count,
    slo_pair,
    tag_pair,
)
from sgl_fair.worker.sglang.settings import is_rt_priority

Req = Any  # sglang.srt.managers.schedule_batch.Req (not imported: the core stays pure)


def client_of(req: Req) -> str:
    """The client a request is charged to: its ``routing_key`` (our router sets it)."""
    key = getattr(req, "routing_key", None)
    return str(key) if key else DEFAULT_CLIENT


def mirror_of(req: Req, now: float, low_priority_first: bool = False) -> Request:
    """Our ``Request`` for an SGLang ``Req``, as submitted (``low_priority_first``: the
    server's ``--schedule-low-priority-values-first``)."""
    max_new = req.sampling_params.max_new_tokens
    max_new = max(1, int(max_new)) if max_new is not None else 1
    m = Request(
        rid=req.rid,
        client=client_of(req),
        input_ids=tuple(req.origin_input_ids),
        output_len=max_new,
        max_new_tokens=max_new,
        arrival_s=now,
        return_logprob=bool(req.return_logprob),
        service_class=class_of(req, low_priority_first),
    )
    slos = slos_of(req)
    if slos is not None:
        m.ttft_slo_s, m.tpot_slo_s = slos
    params = getattr(req.sampling_params, "custom_params", None)
    if isinstance(params, dict):
        if CALL_PARAM in params:  # a FairServe call's interaction
            apply_call_params(m, params[CALL_PARAM])
        m.cluster_inflight = inflight_count(params.get(INFLIGHT_PARAM))  # the router's count
    return m


def slos_of(req: Req) -> tuple[float, float] | None:
    """An RT request's (TTFT, TPOT) SLOs, as our bridge sends them (``SLO_PARAM`` in
    ``custom_params``); None when absent or not valid (``sgl_fair.request.slo_pair``)."""
    params = getattr(req.sampling_params, "custom_params", None)
    return slo_pair(params.get(SLO_PARAM)) if isinstance(params, dict) else None


def tag_of(req: Req) -> tuple[int, int] | None:
    """A router replica's ``(replica, charge)`` for this request, as our bridge sends it
    (``TAG_PARAM`` in ``custom_params``); None when absent or not valid."""
    params = getattr(req.sampling_params, "custom_params", None)
    return tag_pair(params.get(TAG_PARAM)) if isinstance(params, dict) else None


def class_of(req: Req, low_priority_first: bool = False) -> ServiceClass:
    """RT if SGLang's ``priority`` is what our bridge sends for RT requests in this server's
    direction (``settings.class_priority_values``), else BE (the default class)."""
    rt = is_rt_priority(getattr(req, "priority", None), low_priority_first)
    return ServiceClass.RT if rt else ServiceClass.BE
