"""SGLang's HTTP API as the bridge sees it: what a server says about itself, and one request.

* ``probe_server``: version, model, KV capacity and context length from the info endpoints;
* ``generate_body``: a ``Request`` as the body of SGLang's native streaming ``/generate``;
* ``SSEParser`` and ``StreamState``: the stream's events and what they said so far (new token
  ids, cached tokens, logprobs, how it finished);
* ``status_outcome`` and ``error_message``: an HTTP failure as the request's ``FinishReason``
  (REJECTED for the server's 4xx, ABORTED otherwise).

The bridge process (``bridge``) makes the calls; this module knows what they carry. No sglang
import: HTTP only.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from sgl_fair.messages import FinishReason, ServiceReport
from sgl_fair.request import (
    CALL_PARAM,
    INFLIGHT_PARAM,
    SLO_PARAM,
    TAG_PARAM,
    Request,
    ServiceClass,
    call_params,
)
from sgl_fair.worker.sglang.settings import class_priority_values

# A 429 inside a stream carries no Retry-After header: when to retry, then.
DEFAULT_RETRY_AFTER_S = 1.0


# ---- what the server says about itself -------------------------------------------------------


@dataclass(frozen=True)
class ServerInfo:
    version: str = ""
    model_path: str = ""
    kv_capacity_tokens: int = 0  # 0: unknown
    context_len: int | None = None
    incremental: bool = False  # --incremental-streaming-output: chunks carry only new ids
    low_priority_first: bool = False  # --schedule-low-priority-values-first
    plugin: dict[str, Any] | None = None  # our plugin's state (PLUGIN_KEY), None: not on
    info_read: bool = True  # False: neither /server_info nor /get_server_info answered JSON

    @property
    def engine(self) -> str:
        parts = ["sglang", self.version, self.model_path]
        if self.plugin is not None:
            parts.append(f"(sgl-fair {self.plugin.get('policy')})")
        return " ".join(x for x in parts if x)


PLUGIN_KEY = "sgl_fair"  # plugin.INFO_KEY: the plugin's state in SGLang's /server_info


def plugin_check(
    info: ServerInfo, policy: str, opts: dict[str, Any]
) -> tuple[str | None, str | None]:
    """Whether a server runs our plugin with ``policy`` (and ``opts``): ``(refusal, warning)``.
    A server without the plugin, or with another policy, would silently schedule by other
    rules than the ones the router announces: refused. Other options (tenant weights, ...)
    are a warning: the server runs the policy, with its own settings."""
    on = info.plugin
    start = (
        f"start it with SGLFAIR_SCHEDULE_POLICY={policy} (and SGLFAIR_SCHEDULE_POLICY_OPTS) in "
        "its environment, sgl-fair installed beside SGLang"
    )
    if on is None and not info.info_read:
        return (
            "did not answer /server_info, so whether it runs the sgl-fair plugin is unknown "
            "(a server started with --api-key needs --worker-api-key)"
        ), None
    if on is None:
        return f"runs no sgl-fair plugin (its /server_info has no {PLUGIN_KEY!r}); {start}", None
    if on.get("policy") != policy:
        return (
            f"runs the sgl-fair plugin with policy {on.get('policy')!r}, not {policy!r}; {start}",
            None,
        )
    if (on.get("opts") or {}) != (opts or {}):
        return None, (
            f"its sgl-fair plugin runs {policy} with options {on.get('opts')} where the launcher "
            f"has {opts} (tenant weights go to a server through SGLFAIR_SCHEDULE_POLICY_OPTS)"
        )
    return None, None


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The headers of every call to a server started with ``--api-key`` (none without)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def get_json(http: aiohttp.ClientSession, url: str, timeout_s: float) -> Any:
    """The JSON at ``url``, or None when it is not there (any error, non-200, not JSON)."""
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                return None
            return await resp.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


async def service_report(
    http: aiohttp.ClientSession, url: str, timeout_s: float = 5.0
) -> ServiceReport | str:
    """The service ledger our plugin keeps (``worker/sglang/ledger.py``), from the
    scheduler's state in ``/server_info``: a full ``ServiceReport``; else a line saying why
    there is none (the server did not answer; its plugin keeps no ledger; it runs more than
    one scheduler, whose ledgers this bridge cannot tell apart)."""
    info = await get_json(http, url + "/server_info", timeout_s)
    states = info.get("internal_states") if isinstance(info, dict) else None
    if not isinstance(states, list) or not states:
        return "its /server_info did not answer with the schedulers' state"
    if len(states) > 1:
        return f"it runs {len(states)} schedulers (data parallel inside one server)"
    plugin = states[0].get(PLUGIN_KEY) if isinstance(states[0], dict) else None
    raw = plugin.get("service") if isinstance(plugin, dict) else None
    if raw is None:
        return "its sgl-fair plugin keeps no service ledger (an older sgl-fair)"
    try:
        return msgspec.convert(raw, ServiceReport)
    except msgspec.ValidationError as e:
        return f"its plugin's service ledger is not one: {e}"


def _positive_int(*values: Any) -> int | None:
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


async def probe_server(
    http: aiohttp.ClientSession, url: str, timeout_s: float = 30.0
) -> ServerInfo:
    """Version, model, KV capacity and context length from the server's info endpoints
    (``/server_info`` then ``/get_server_info``; ``/model_info``; ``/v1/models``); what a
    server does not report stays unknown."""
    info = await get_json(http, url + "/server_info", timeout_s)
    if not isinstance(info, dict):
        info = await get_json(http, url + "/get_server_info", timeout_s)
    info_read = isinstance(info, dict)
    info = info if info_read else {}
    model = await get_json(http, url + "/model_info", timeout_s)
    if not isinstance(model, dict):
        model = await get_json(http, url + "/get_model_info", timeout_s)
    model = model if isinstance(model, dict) else {}
    models = await get_json(http, url + "/v1/models", timeout_s)
    cards = models.get("data") if isinstance(models, dict) else None
    card = cards[0] if isinstance(cards, list) and cards and isinstance(cards[0], dict) else {}
    return ServerInfo(
        version=str(info.get("version") or ""),
        model_path=str(model.get("model_path") or info.get("model_path") or ""),
        kv_capacity_tokens=_positive_int(
            info.get("max_total_num_tokens"), model.get("max_total_num_tokens")
        )
        or 0,
        context_len=_positive_int(
            card.get("max_model_len"), model.get("context_length"), info.get("context_length")
        ),
        incremental=bool(info.get("incremental_streaming_output", False)),
        low_priority_first=bool(info.get("schedule_low_priority_values_first", False)),
        plugin=info.get(PLUGIN_KEY) if isinstance(info.get(PLUGIN_KEY), dict) else None,
        info_read=info_read,
    )


# ---- one request -----------------------------------------------------------------------------


def generate_body(
    req: Request,
    *,
    rid: str | None = None,
    class_priority: bool = False,
    low_priority_first: bool = False,
    tag: tuple[int, int] | None = None,
    inflight: bool = False,
) -> dict[str, Any]:
    """The streaming ``/generate`` body for ``req`` (SGLang's native API), sent as ``rid``
    (the bridge's own unique rid per call; default the request's). The client's
    pass-through fields (``req.extra``: LoRA, custom logit processors, images, ...) and
    sampling keys (``req.sampling``: constrained decoding, ...) go in untouched; the keys
    the bridge itself sets (prompt, streaming, rid, logprobs; ``class_priority``: the
    request's RT/BE class as SGLang's ``priority`` in the server's direction,
    ``low_priority_first``, and an RT request's SLOs in ``custom_params``) win; ``tag``: a
    router replica's ``(replica, charge)`` for the plugin's service ledger (``TAG_PARAM``);
    ``inflight``: the server runs our plugin, so send the router's count of the client's
    calls in flight for its share guard (``INFLIGHT_PARAM``). A client's own value of either
    key never reaches the server."""
    sampling = dict(req.sampling or {})
    params = sampling.get("custom_params")
    if isinstance(params, dict) and (TAG_PARAM in params or INFLIGHT_PARAM in params):
        params = {k: v for k, v in params.items() if k not in (TAG_PARAM, INFLIGHT_PARAM)}
        sampling["custom_params"] = params
    if tag is not None:
        params = sampling["custom_params"] = {**(params or {}), TAG_PARAM: list(tag)}
    if inflight and req.cluster_inflight is not None:  # for the plugin's share guard
        sampling["custom_params"] = {**(params or {}), INFLIGHT_PARAM: req.cluster_inflight}
    sampling["max_new_tokens"] = req.max_new_tokens
    body: dict[str, Any] = {
        "input_ids": list(req.input_ids),
        "sampling_params": sampling,
        "stream": True,
        "rid": req.rid if rid is None else rid,
        "routing_key": req.client,
    }
    if class_priority:
        rt = req.service_class is ServiceClass.RT
        rt_value, be_value = class_priority_values(low_priority_first)
        body["priority"] = rt_value if rt else be_value
        if rt:
            params = dict(sampling.get("custom_params") or {})
            params[SLO_PARAM] = [req.ttft_slo_s, req.tpot_slo_s]
            sampling["custom_params"] = params
    call = call_params(req)
    if call is not None:  # a FairServe call: its interaction, for the plugin's FairServe
        params = dict(sampling.get("custom_params") or {})
        params[CALL_PARAM] = call
        sampling["custom_params"] = params
    if req.return_logprob:
        body["return_logprob"] = True
        body["logprob_start_len"] = req.logprob_start_len
        if req.top_logprobs_num:
            body["top_logprobs_num"] = req.top_logprobs_num
    for key, value in (req.extra or {}).items():  # the client's pass-through fields
        body.setdefault(key, value)
    return body


class SSEParser:
    """Server-sent events from arbitrary byte chunks: the payloads of ``data:`` lines (no line
    length limit; SGLang's cumulative chunks grow with the output)."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        out = []
        for line in lines:
            line = line.rstrip(b"\r")
            if line.startswith(b"data:"):
                out.append(line[5:].strip())
        return out


@dataclass(frozen=True)
class Outcome:
    reason: FinishReason
    error: str | None = None
    retry_after_s: float | None = None


_RETRY_AFTER_TEXT = re.compile(r"retry after ([0-9]+(?:\.[0-9]*)?)\s*s")


def status_outcome(status: Any, message: str, retry_after_s: float | None = None) -> Outcome:
    """A failure the server answered with HTTP ``status``: its 4xx refuse the request
    (429: for now), anything else aborts it. A 429 inside a stream has no Retry-After header;
    our plugin's refusal says "(retry after 2.5s)" in its message."""
    if status == 429:
        if retry_after_s is None:
            m = _RETRY_AFTER_TEXT.search(message)
            retry_after_s = float(m.group(1)) if m else DEFAULT_RETRY_AFTER_S
        return Outcome(FinishReason.REJECTED, message, retry_after_s)
    if isinstance(status, int) and 400 <= status < 500:
        return Outcome(FinishReason.REJECTED, message)
    return Outcome(FinishReason.ABORTED, message)


def error_message(body: str, status: int | None = None) -> str:
    """The message in an error body: SGLang's / OpenAI's ``{"error": ...}``, FastAPI's
    ``{"detail": ...}``, or the text itself."""
    text = body.strip()
    try:
        obj = json.loads(text) if text else None
    except ValueError:
        obj = None
    msg: Any = None
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail", obj.get("message")))
        msg = err.get("message", err) if isinstance(err, dict) else err
    if msg is None or msg == "":
        msg = text[:500] or (f"HTTP {status}" if status is not None else "error")
    return msg if isinstance(msg, str) else json.dumps(msg)[:500]


def retry_after_header(header: str | None) -> float | None:
    """A ``Retry-After`` header's seconds; None when absent or not a finite number >= 0."""
    try:
        value = float(header) if header is not None else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) and value >= 0 else None


class StreamState:
    """What the chunks of one ``/generate`` stream said so far.

    SGLang sends cumulative ``output_ids`` (and output logprobs) in every chunk unless the
    server runs with ``--incremental-streaming-output``; ``feed`` returns the new ids either way.
    """

    def __init__(self, *, incremental: bool = False, want_logprobs: bool = False) -> None:
        self.incremental = incremental
        self.want_logprobs = want_logprobs
        self.output_ids: list[int] = []
        self.cached_tokens = 0
        self.queue_s: float | None = None  # SGLang's meta_info.queue_time, when it sends one
        self.finish: dict[str, Any] | None = None
        self.error: tuple[Any, str] | None = None  # (status code, message) of an error event
        self.logprobs: dict[str, list[Any]] = {}

    def feed(self, obj: Any) -> list[int]:
        if not isinstance(obj, dict):
            self.error = (None, f"unexpected stream event: {str(obj)[:200]}")
            return []
        if "error" in obj:
            err = obj["error"]
            code = err.get("code") if isinstance(err, dict) else None
            self.error = (code, error_message(json.dumps(obj)))
            return []
        meta = obj.get("meta_info") or {}
        new = self._take(obj.get("output_ids"), meta.get("cached_tokens"),
                         meta.get("queue_time"), meta.get("finish_reason"))  # fmt: skip
        if self.want_logprobs:
            self._take_logprobs(meta)
        return new

    def feed_bytes(self, payload: bytes) -> list[int]:
        """``feed`` of one event's JSON, reading only the fields the bridge uses (SGLang's
        chunks also carry the whole text so far and a dozen counters): the common event
        without logprobs or an error is decoded into a struct of those fields; any other
        takes ``feed``'s path. A ValueError when it is not JSON."""
        if not self.want_logprobs:
            try:
                ev = _decode_event(payload)
            except msgspec.ValidationError:
                ev = None  # not the plain shape: the general path says what it is
            if ev is not None and ev.error is msgspec.UNSET:
                m = ev.meta_info
                if m is None:
                    return self._take(ev.output_ids, None, None, None)
                return self._take(ev.output_ids, m.cached_tokens, m.queue_time, m.finish_reason)
        return self.feed(decode_json(payload))

    def _take(self, ids: Any, cached: Any, queued: Any, finish: Any) -> list[int]:
        ids = ids or []
        new = list(ids) if self.incremental else list(ids[len(self.output_ids) :])
        self.output_ids.extend(new)
        if isinstance(cached, int):
            self.cached_tokens = cached
        if isinstance(queued, (int, float)) and not isinstance(queued, bool) and queued >= 0:
            self.queue_s = float(queued)
        if finish is not None:
            self.finish = finish
        return new

    def _take_logprobs(self, meta: dict[str, Any]) -> None:
        for key in ("input_token_logprobs", "output_token_logprobs", "output_top_logprobs"):
            value = meta.get(key)
            if value is None:
                continue
            if self.incremental and key != "input_token_logprobs":
                self.logprobs.setdefault(key, []).extend(value)  # sliced to the new tokens
            else:
                self.logprobs[key] = list(value)  # cumulative: the latest is complete

    def outcome(self, requested_abort: str | None) -> Outcome:
        """How the request ended, once the stream has (``requested_abort``: the router asked
        us to abort it, and why)."""
        if self.error is not None:
            code, msg = self.error
            if requested_abort is not None:
                return Outcome(FinishReason.ABORTED, requested_abort)
            return status_outcome(code, msg)
        finish = self.finish
        if finish is None:
            return Outcome(FinishReason.ABORTED, requested_abort or "the stream ended early")
        kind = finish.get("type") if isinstance(finish, dict) else None
        if kind == "length":
            return Outcome(FinishReason.LENGTH)
        if kind == "stop":
            return Outcome(FinishReason.STOP)
        if requested_abort is not None:
            return Outcome(FinishReason.ABORTED, requested_abort)
        msg = finish.get("message") if isinstance(finish, dict) else None
        status = finish.get("status_code") if isinstance(finish, dict) else None
        return status_outcome(status, str(msg or "aborted by the SGLang server"))

    def finished_logprobs(self) -> dict[str, Any]:
        """``Finished``'s logprob fields from SGLang's ``[logprob, token_id, text]`` triples."""
        if not self.want_logprobs:
            return {}
        lp = self.logprobs
        n = len(self.output_ids)
        out: dict[str, Any] = {
            "input_logprobs": tuple(
                None if e[0] is None else float(e[0]) for e in lp.get("input_token_logprobs", ())
            ),
            "output_logprobs": tuple(
                float(e[0]) if e[0] is not None else -math.inf
                for e in lp.get("output_token_logprobs", ())[:n]
            ),
        }
        if "output_top_logprobs" in lp:
            out["output_top_logprobs"] = tuple(
                tuple((float(e[0]), int(e[1])) for e in row if e[0] is not None) if row else ()
                for row in lp["output_top_logprobs"][:n]
            )
        return out


decode_json = msgspec.json.Decoder().decode  # a ValueError on bad JSON; faster than json


class _Meta(msgspec.Struct, gc=False):
    cached_tokens: Any = None
    queue_time: Any = None
    finish_reason: Any = None


class _Event(msgspec.Struct, gc=False):
    """The fields of a stream event the bridge reads; the rest is skipped, not built."""

    output_ids: Any = None
    meta_info: _Meta | None = None
    error: Any = msgspec.UNSET


_decode_event = msgspec.json.Decoder(_Event).decode

__all__ = [
    "DEFAULT_RETRY_AFTER_S",
    "PLUGIN_KEY",
    "plugin_check",
    "auth_headers",
    "Outcome",
    "SSEParser",
    "ServerInfo",
    "StreamState",
    "decode_json",
    "error_message",
    "generate_body",
    "get_json",
    "probe_server",
    "retry_after_header",
    "service_report",
    "status_outcome",
]
