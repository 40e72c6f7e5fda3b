"""The request: what a client asked for, and where it is in its life.

A ``Request`` is created by a workload (or the HTTP front) and then mutated by
exactly one scheduler. Fields above the marker are the request as submitted;
fields below are the scheduler's bookkeeping.

Lengths follow the papers' experiments: a request generates exactly
``output_len`` tokens (EOS ignored); ``max_new_tokens`` is what the scheduler
may assume when reserving memory (it never sees ``output_len`` except through an
``oracle`` predictor, which is the point of that baseline).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field, fields
from typing import Any

ClientId = str
DEFAULT_CLIENT: ClientId = "default"


class Phase(enum.Enum):
    """Where a request is. RETRACTED requests are back in the waiting queue."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    REJECTED = "rejected"
    ABORTED = "aborted"  # cancelled (client disconnect, stop string matched, shutdown)


class ServiceClass(str, enum.Enum):
    """BROS service class: real-time (latency SLOs) or best-effort (throughput)."""

    RT = "rt"
    BE = "be"


# Default SLOs from the BROS paper (per request overridable).
DEFAULT_TTFT_SLO_S = 0.4
DEFAULT_TPOT_SLO_S = 0.2
# Where a request's [ttft_slo_s, tpot_slo_s] ride to an SGLang server: a key of SGLang's
# per-request `sampling_params.custom_params` (carried to its scheduler; SGLang keeps its own
# per-request keys there too). Our bridge writes it, our plugin and our server read it.
SLO_PARAM = "sgl_fair_slo_s"
MAX_SLO_S = 3600.0  # the largest SLO a request may ask for (seconds)


def valid_slo(v: Any) -> bool:
    """Whether ``v`` is an SLO: a number (not a bool), finite, in (0, MAX_SLO_S]."""
    return (type(v) is int or type(v) is float) and 0 < v <= MAX_SLO_S


def slo_pair(value: Any) -> tuple[float, float] | None:
    """``(ttft_slo_s, tpot_slo_s)`` from ``SLO_PARAM``'s value, or None when it is not two
    SLOs (``valid_slo``). The one contract for that key: our server refuses a request
    whose value fails it, naming the field; our SGLang plugin, which must never raise inside
    SGLang's scheduler, ignores the value instead."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return None
    if not (valid_slo(value[0]) and valid_slo(value[1])):
        return None
    return float(value[0]), float(value[1])


# Where a FairServe call's identity rides to an SGLang server, beside ``SLO_PARAM``: what
# our bridge writes for a call of an interaction (``call_params``) and our plugin reads back
# (``apply_call_params``), so FairServe inside SGLang sees interactions as at our router.
CALL_PARAM = "sgl_fair_call"
_MAX_NAME = 256  # an interaction id or app name longer than this is not ours: ignored


def call_params(req: Request) -> dict[str, Any] | None:
    """A call's interaction fields for ``CALL_PARAM`` (None when it has none to send)."""
    out: dict[str, Any] = {}
    if req.interaction_id is not None:
        out["interaction"] = req.interaction_id
    if req.app is not None:
        out["app"] = req.app
    if req.stage:
        out["stage"] = req.stage
    if req.system_len is not None:
        out["system_len"] = req.system_len
    if req.oit_checked:
        out["oit_checked"] = True
    return out or None


def apply_call_params(req: Request, value: Any) -> None:
    """Set ``req``'s interaction fields from ``CALL_PARAM``'s value, each only where it is
    of its kind (a string of at most 256 characters, a count >= 0, a bool); never raises
    (the plugin runs inside SGLang's scheduler): anything else is left as it was."""
    if not isinstance(value, dict):
        return
    iid, app = value.get("interaction"), value.get("app")
    if isinstance(iid, str) and 0 < len(iid) <= _MAX_NAME:
        req.interaction_id = iid
    if isinstance(app, str) and 0 < len(app) <= _MAX_NAME:
        req.app = app
    stage, system = value.get("stage"), value.get("system_len")
    if type(stage) is int and stage >= 0:
        req.stage = stage
    if type(system) is int and system >= 0:
        req.system_len = system
    if value.get("oit_checked") is True:
        req.oit_checked = True


# Where a router replica's dispatch tag rides to an SGLang server (``[replica, charge]``:
# who dispatched it and the extend tokens it charged the client): what our bridge writes
# and our plugin's service ledger reads back (``tag_pair``), so replicas over SGLang servers
# share one fairness state as over standalone workers (docs/replicas.md).
TAG_PARAM = "sgl_fair_tag"


def tag_pair(value: Any) -> tuple[int, int] | None:
    """``(replica, charge)`` from ``TAG_PARAM``'s value, or None unless it is two ints >= 0
    (never raises: the plugin runs inside SGLang's scheduler)."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return None
    replica, charge = value
    if type(replica) is not int or type(charge) is not int or replica < 0 or charge < 0:
        return None
    return replica, charge


# Where ``Request.cluster_inflight`` rides to an SGLang server: what our bridge writes and
# our plugin reads back (``inflight_count``), so the share guard inside SGLang compares
# clients by their load over the cluster, as in our own engine.
INFLIGHT_PARAM = "sgl_fair_inflight"
MAX_INFLIGHT = 10_000_000  # a larger count is not one our router sends: ignored


def inflight_count(value: Any) -> int | None:
    """``INFLIGHT_PARAM``'s value as a count of calls (1 .. ``MAX_INFLIGHT``), or None (never
    raises: the plugin runs inside SGLang's scheduler)."""
    if type(value) is not int or not 1 <= value <= MAX_INFLIGHT:
        return None
    return value


_seq = itertools.count()


@dataclass(eq=False)
class Request:
    """One LLM call. Identity is object identity (``eq=False``); ``rid`` is for humans and wires."""

    rid: str
    client: ClientId
    input_ids: tuple[int, ...]
    output_len: int
    arrival_s: float
    max_new_tokens: int | None = None
    # BROS
    service_class: ServiceClass = ServiceClass.BE
    ttft_slo_s: float = DEFAULT_TTFT_SLO_S
    tpot_slo_s: float = DEFAULT_TPOT_SLO_S
    # FairServe: a request may be one call of a multi-call interaction.
    interaction_id: str | None = None
    app: str | None = None
    stage: int = 0
    # FairServe's L_S: prompt tokens that are its system prompt (chat: the system messages';
    # native: a declared length). None: the app's configured ``system_lens[app]``.
    system_len: int | None = None
    # Set by a router running FairServe's cluster OIT over several workers when that OIT let
    # the call through: it judged the call over the whole cluster (every call of its
    # interaction, on any worker), so a worker's own OIT, which sees only the calls routed to
    # it, must not refuse it (it would cut an interaction whose other calls run elsewhere).
    oit_checked: bool = False
    # Set by the router at dispatch: this client's calls in flight over the whole cluster,
    # this one included (None: no router dispatched it). A worker sees only its own share of
    # a client's load; the share guard compares clients by this count (``worker/share_guard.py``).
    cluster_inflight: int | None = None
    # Workload provenance: the prompt starts with `group_prefix_len` tokens shared by every
    # request of `prefix_group` (what a trace line says; the scheduler never reads it).
    prefix_group: str | None = None
    group_prefix_len: int | None = None
    # Serving: log-probabilities to return with the result (SGLang's `return_logprob`):
    # prompt positions from `logprob_start_len` on (-1: none) and every output token, with
    # the `top_logprobs_num` most likely alternatives per output position.
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    # Engine-specific sampling parameters passed through to a real engine (SGLang's
    # ``sampling_params`` keys, e.g. temperature, top_p, stop_token_ids); None: the engine's
    # defaults. The simulator ignores them.
    sampling: dict[str, Any] | None = None
    # Top-level fields of SGLang's /generate passed through untouched to a real engine
    # (lora_path, custom_logit_processor, image_data, ...); None: none. The simulator
    # never sees any (the front refuses them for it).
    extra: dict[str, Any] | None = None

    # ---- scheduler bookkeeping (below this line nothing is set by the submitter) ----
    phase: Phase = Phase.WAITING
    output_ids: list[int] = field(default_factory=list)
    # Tokens of (input_ids + output_ids) whose KV is computed and held by this request,
    # counting the matched prefix.
    num_computed: int = 0
    # Prefix matched in the worker's cache at the (latest) admission.
    prefix_len: int = 0
    # Prefix matched at the first admission; what cache-hit metrics count.
    first_prefix_len: int | None = None
    admit_s: float | None = None
    # Seconds spent in the waiting queue, summed over every wait (a retracted request queues
    # again): SGLang's ``meta_info.queue_time``. ``queued_s``: when the current wait began.
    queue_s: float = 0.0
    queued_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    num_retractions: int = 0
    reject_reason: str | None = None
    # Set when a policy's admission control refused the request for now (HTTP 429 + Retry-After
    # in serving); None for a request that can never run here (HTTP 400).
    reject_retry_after_s: float | None = None
    # The admission limit that refused it: (limit, max requests, window s), e.g. FairServe's
    # ("user", 10, 60.0); None for any other refusal.
    reject_limit: tuple[str, int, float] | None = None
    abort_reason: str | None = None
    # Arrival tie-breaker: a process-wide sequence number, so orders are total and stable.
    seq: int = field(default_factory=lambda: next(_seq))

    def __post_init__(self) -> None:
        if not isinstance(self.input_ids, tuple):
            self.input_ids = tuple(self.input_ids)
        if self.max_new_tokens is None:
            self.max_new_tokens = self.output_len
        if len(self.input_ids) < 1:
            raise ValueError(f"request {self.rid!r}: input must have at least one token")
        if self.output_len < 1:
            raise ValueError(f"request {self.rid!r}: output_len must be >= 1")
        if self.max_new_tokens < self.output_len:
            raise ValueError(f"request {self.rid!r}: max_new_tokens < output_len")

    def unscheduled_copy(self) -> Request:
        """The request as submitted, with fresh bookkeeping (replay one workload many times)."""
        return Request(**{name: getattr(self, name) for name in SUBMITTED_FIELDS})

    @property
    def input_len(self) -> int:
        return len(self.input_ids)

    @property
    def num_output(self) -> int:
        return len(self.output_ids)

    @property
    def seq_len(self) -> int:
        """Tokens the request holds context for: input plus generated output."""
        return self.input_len + len(self.output_ids)

    @property
    def done(self) -> bool:
        return len(self.output_ids) >= self.output_len

    @property
    def remaining_new_tokens(self) -> int:
        """Tokens the scheduler must still reserve room for (by max_new_tokens)."""
        return self.max_new_tokens - len(self.output_ids)

    def all_ids(self) -> tuple[int, ...]:
        """Input followed by generated output: the tokens a re-prefill must compute."""
        if not self.output_ids:
            return self.input_ids  # no copy: the common case, matched on every admission walk
        return self.input_ids + tuple(self.output_ids)

    def arrival_key(self) -> tuple[float, int]:
        return (self.arrival_s, self.seq)

    def __repr__(self) -> str:  # short: requests appear in assertion messages
        return (
            f"Request({self.rid!r}, client={self.client!r}, in={self.input_len}, "
            f"out={len(self.output_ids)}/{self.output_len}, {self.phase.value})"
        )


# The fields a submitter sets; everything after them is the scheduler's bookkeeping.
SUBMITTED_FIELDS: tuple[str, ...] = tuple(
    f.name for f in fields(Request)[: [f.name for f in fields(Request)].index("phase")]
)
