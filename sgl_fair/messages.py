"""Router ↔ worker messages (ARCHITECTURE seam #3), one set for every transport.

The cluster simulator passes these objects through in-process queues with a network
delay; the live cluster sends the same structs over zmq (msgspec encodes them). Every
message names its ``worker``; times are the sender's clock (virtual or wall).

    router ──Dispatch──▶ worker            a request to queue
    router ◀──Tokens──── worker            new output tokens of one engine step
    router ◀─Finished─── worker            a request left: finished, rejected or aborted
    router ◀─Evicted──── worker            prefixes dropped from the worker's KV cache
    router ◀───Load───── worker            queue and memory gauges (periodic; also the heartbeat)

Live-cluster control messages (zmq only): ``Abort`` and ``FlushCache`` / ``Shutdown`` go to a
worker; a worker announces itself with ``Hello`` and answers a flush with ``Flushed``. KV
cache changes travel separately, in SGLang's own KV-event format (``sgl_fair.kv_events``).

``Dispatch`` carries the ``Request`` object; its wire form is the request's
``SUBMITTED_FIELDS`` (the scheduler's bookkeeping never travels).
"""

from __future__ import annotations

import enum

import msgspec

from sgl_fair.request import Request

PROTOCOL_VERSION = 4  # 4: Request.cluster_inflight; 3: a replica's tag rides in Dispatch.tag

Tokens_ = tuple[int, ...]


class FinishReason(str, enum.Enum):
    LENGTH = "length"  # produced its output_len / max_new_tokens
    STOP = "stop"  # a stop condition (live engines)
    REJECTED = "rejected"  # refused at arrival (policy admission control, too large)
    ABORTED = "aborted"  # cancelled by the client or lost with its worker


class Dispatch(msgspec.Struct, frozen=True, gc=False):
    worker: int
    req: Request
    sent_s: float
    # A router replica's ``(replica, charge)`` for the worker's service ledger
    # (``router/replica.py``): a bridge sends it to its SGLang server's plugin, a standalone
    # worker adds it to its own ledger (``sgl_fair/remote.py``).
    tag: tuple[int, int] | None = None


class Tokens(msgspec.Struct, frozen=True, gc=False):
    """Tokens produced by one engine step: ``items`` holds ``(rid, new token ids)``."""

    worker: int
    t_s: float
    items: tuple[tuple[str, Tokens_], ...]


class Finished(msgspec.Struct, frozen=True, gc=False):
    worker: int
    t_s: float
    rid: str
    client: str
    reason: FinishReason
    input_ids: Tokens_  # what the worker computed (for the router's tree)
    output_ids: Tokens_
    prefix_len: int = 0  # cached prefix at (first) admission on the worker
    error: str | None = None  # why, for REJECTED / ABORTED
    # Only when the request asked for them (``Request.return_logprob``): log-probabilities of
    # prompt positions logprob_start_len.. (None where undefined: position 0), of each output
    # token, and each output position's top alternatives as (logprob, token id).
    input_logprobs: tuple[float | None, ...] | None = None
    output_logprobs: tuple[float, ...] | None = None
    output_top_logprobs: tuple[tuple[tuple[float, int], ...], ...] | None = None
    # REJECTED by a policy's admission control: when to retry (None: it can never run there).
    retry_after_s: float | None = None
    # ... and by which windowed limit: (limit, max requests, window s), e.g. ("user", 10, 60.0)
    limit: tuple[str, int, float] | None = None
    # Seconds the request spent in the worker's waiting queue (SGLang's meta_info.queue_time;
    # summed over re-queues); None when it was never admitted or the engine does not say.
    queue_s: float | None = None
    # ABORTED because the worker lost its engine (an SGLang server that went away under the
    # call), not for anything of the call's own: the router takes it as the worker's death and
    # sends the call elsewhere when no token of it reached the client yet.
    lost: bool = False

    @property
    def input_len(self) -> int:
        return len(self.input_ids)

    @property
    def num_output(self) -> int:
        return len(self.output_ids)

    @property
    def ok(self) -> bool:
        return self.reason in (FinishReason.LENGTH, FinishReason.STOP)


class Evicted(msgspec.Struct, frozen=True, gc=False):
    """Each block is ``(path, start)``: the worker no longer holds ``path[start:]`` (nor
    anything below it); ``path[:start]`` is unaffected by this block."""

    worker: int
    t_s: float
    blocks: tuple[tuple[Tokens_, int], ...]


class ServiceReport(msgspec.Struct, frozen=True, gc=False):
    """A worker's service ledger, sent with its ``Load`` so that router replicas share one
    fairness state (``docs/replicas.md``, ``worker/service_ledger.py``,
    ``router/replica_state.py``): one row per (replica, client), each the running totals of
    what that replica's dispatches here were charged and served — a G-counter row that only
    its replica's dispatches grow, so a replica adds up the other replicas' rows and counts
    its own itself. Totals, never deltas: a lost report loses nothing."""

    boot: int  # the worker process's boot id (``Hello.boot``): a new one starts every row over
    # (replica, client, extend tokens charged at dispatch, output tokens of the Finished
    # sent so far, the row's birth: a worker-wide counter, new when a forgotten row returns)
    rows: tuple[tuple[int, str, int, int, int], ...] = ()
    # True: every row the worker keeps (a snapshot; rows not listed were forgotten, idle);
    # False: only the rows changed since the previous report.
    full: bool = True
    requests: tuple[tuple[int, int], ...] = ()  # (replica, its requests here now), nonzero
    num_requests: int = 0  # every request here (tagged or not): received, no Finished sent
    # Interaction ids (FairServe) with a call here now, or whose call's Finished went out
    # since the last report: every replica learns the interactions under way (the cluster
    # OIT never refuses their next call, whichever replica it reaches).
    interactions: tuple[str, ...] = ()


class Load(msgspec.Struct, frozen=True, gc=False):
    worker: int
    t_s: float
    num_waiting: int
    num_running: int
    kv_used_tokens: int  # held by running requests (locked + private)
    kv_cached_tokens: int  # evictable prefix cache
    kv_capacity_tokens: int
    # Requests retracted (preempted, to recompute) since the worker started; 0 where the
    # engine does not say (SGLang's bridge).
    num_retractions: int = 0
    # Per-client service totals, for router replicas (None where the worker keeps none).
    service: ServiceReport | None = None
    boot: int = 0  # its process's boot id, as in its Hello (0: not said)
    # The worker is stopping (SIGTERM): it finishes what it holds, then exits; choose it for
    # nothing new (``python -m sgl_fair.worker --drain-timeout-s``).
    draining: bool = False


class Abort(msgspec.Struct, frozen=True, gc=False):
    """Cancel a request (client gone, stop string matched); answered by its ``Finished``."""

    worker: int
    rid: str
    reason: str = "aborted by client"


class FlushCache(msgspec.Struct, frozen=True, gc=False):
    """Drop the worker's unlocked prefix cache (SGLang's /flush_cache); answered by ``Flushed``."""

    worker: int
    token: int  # echoed back, to pair the answer with the call


class Shutdown(msgspec.Struct, frozen=True, gc=False):
    worker: int


class Hello(msgspec.Struct, frozen=True, gc=False):
    """A worker is up: sent once at start (and again if the router asks)."""

    worker: int
    t_s: float
    pid: int
    kv_capacity_tokens: int
    engine: str  # e.g. "sim H100-80GB Llama-3.1-8B"
    version: int = PROTOCOL_VERSION
    context_len: int = 0  # the longest sequence its model serves; 0: not known
    # Random per process: a new one is a new process (a restart with the same pid, pid 1 of
    # its container every time, included); 0: not said.
    boot: int = 0


class KVSnapshot(msgspec.Struct, frozen=True, gc=False):
    """A standalone worker's prefix cache as it is, for a router replica that attaches: the
    KV events that store every full page it holds (``payload``: one ``KVEventBatch`` in
    SGLang's encoding, ``sgl_fair.kv_events``). KV events are published as the cache changes,
    so without it a replica that joins late knows nothing of what was cached before."""

    worker: int
    t_s: float
    payload: bytes


class Flushed(msgspec.Struct, frozen=True, gc=False):
    worker: int
    token: int
    ok: bool


WorkerMessage = Tokens | Finished | Evicted | Load

__all__ = [
    "PROTOCOL_VERSION",
    "Abort",
    "Dispatch",
    "FlushCache",
    "Flushed",
    "Hello",
    "KVSnapshot",
    "Shutdown",
    "Evicted",
    "Finished",
    "FinishReason",
    "Load",
    "Tokens",
    "WorkerMessage",
]
