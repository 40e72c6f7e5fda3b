"""Workloads as requests: synthetic clients and JSONL trace replay.

::

    [ClientSpec, ...] --generate_records--+
                                          +--> [TraceRecord] --to_requests--> [Request]
    trace.jsonl ----parse_trace_records---+          |
                 <----------save_trace---------------+

A :class:`TraceRecord` is one request described by lengths (one JSONL line; the record and
its parser are in ``trace_records.py``, re-exported here). Token ids are
made from lengths by :func:`to_requests` alone, so a generated workload saved as a trace
and loaded back with the same seed gives the same requests, token ids included.

Token ids: each client draws its prompts from its own stream (seeded by ``seed`` and a
stable hash of the client name). A request in a prefix group starts with the first
``prefix_len`` tokens of that group's stream (seeded by ``seed`` and the group name), and
its next token differs from the group's, so it shares exactly ``prefix_len`` tokens with
the group.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import KW_ONLY, dataclass

import numpy as np

from sgl_fair.request import DEFAULT_TPOT_SLO_S, DEFAULT_TTFT_SLO_S, Request, ServiceClass

from .arrivals import ArrivalProcess
from .lengths import LengthDist, as_length_dist
from .trace_records import (
    TraceError,
    TraceRecord,
    _default_rids,
    _FieldError,
    _need_int,
    parse_trace_records,
)

__all__ = [
    "ClientSpec",
    "TraceError",
    "TraceRecord",
    "client_weights",
    "generate",
    "generate_records",
    "group_tokens",
    "load_trace",
    "parse_trace_lines",
    "parse_trace_records",
    "record_of",
    "save_trace",
    "stable_hash",
    "to_requests",
]

DEFAULT_VOCAB_SIZE = 32000

# Tags keep the seeded streams apart: SeedSequence([seed, tag, ...]).
_TAG_SPEC, _TAG_CLIENT_TOKENS, _TAG_GROUP_TOKENS = 1, 2, 3
# Group streams are drawn in fixed blocks so a longer prefix extends a shorter one.
_GROUP_BLOCK_LEN = 4096


def stable_hash(name: str) -> int:
    """A 64-bit hash that is the same in every process (unlike ``hash()``, which is salted)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


# ---------------------------------------------------------------------------------------------
# Records -> requests (token ids)


def _check_seed(seed: int, vocab_size: int) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0 (got {seed!r})")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"vocab_size must be an integer >= 2 (got {vocab_size!r})")


def group_tokens(
    group: str, length: int, *, seed: int = 0, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> np.ndarray:
    """The first ``length`` tokens of a prefix group's stream (a numpy int64 array)."""
    num_blocks = -(-length // _GROUP_BLOCK_LEN)
    key = stable_hash(group)
    blocks = [
        np.random.default_rng([seed, _TAG_GROUP_TOKENS, key, b]).integers(
            0, vocab_size, _GROUP_BLOCK_LEN, dtype=np.int64
        )
        for b in range(num_blocks)
    ]
    return np.concatenate(blocks)[:length] if blocks else np.zeros(0, dtype=np.int64)


def to_requests(
    records: Sequence[TraceRecord], *, seed: int = 0, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> list[Request]:
    """Materialize records as requests, sorted by arrival (stably), with token ids."""
    _check_seed(seed, vocab_size)
    records = sorted(records, key=lambda r: r.arrival_s)
    rids = _default_rids(records)
    if len(set(rids)) != len(rids):
        dup = next(r for r in rids if rids.count(r) > 1)
        raise ValueError(f"duplicate rid {dup!r}")

    prefix_lens = [rec.prefix_len or 0 for rec in records]
    group_need: dict[str, int] = {}  # one token past the longest prefix: the divergence check
    suffix_total: dict[str, int] = {}
    for rec, p in zip(records, prefix_lens, strict=True):
        if rec.prefix_group is not None:
            group_need[rec.prefix_group] = max(group_need.get(rec.prefix_group, 0), p + 1)
        suffix_total[rec.client] = suffix_total.get(rec.client, 0) + rec.input_len - p
    groups = {
        g: group_tokens(g, n, seed=seed, vocab_size=vocab_size) for g, n in group_need.items()
    }

    # One draw per client (fast, and independent of every other client), then sliced.
    flat: dict[str, np.ndarray] = {}
    for client, total in suffix_total.items():
        rng = np.random.default_rng([seed, _TAG_CLIENT_TOKENS, stable_hash(client)])
        flat[client] = rng.integers(0, vocab_size, total, dtype=np.int64)
    offsets = dict.fromkeys(flat, 0)
    spans = []
    for rec, p in zip(records, prefix_lens, strict=True):
        start = offsets[rec.client]
        offsets[rec.client] = start + rec.input_len - p
        spans.append(start)
        if rec.prefix_group is not None and rec.input_len > p:
            tokens, diverge = flat[rec.client], groups[rec.prefix_group][p]
            if tokens[start] == diverge:  # share exactly p tokens with the group, not p + 1
                tokens[start] = (diverge + 1) % vocab_size

    with _gc_paused():
        return _build(records, rids, prefix_lens, spans, flat, groups)


@contextlib.contextmanager
def _gc_paused():
    # Building creates no reference cycles, but millions of token references make the
    # collector's full passes (triggered by the many new tuples) dominate the time.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _build(
    records: list[TraceRecord],
    rids: list[str],
    prefix_lens: list[int],
    spans: list[int],
    flat: dict[str, np.ndarray],
    groups: dict[str, np.ndarray],
) -> list[Request]:
    flat_lists = {c: a.tolist() for c, a in flat.items()}
    group_lists = {g: tuple(a.tolist()) for g, a in groups.items()}
    out = []
    for rec, rid, p, start in zip(records, rids, prefix_lens, spans, strict=True):
        suffix = flat_lists[rec.client][start : start + rec.input_len - p]
        prefix = group_lists[rec.prefix_group][:p] if rec.prefix_group is not None else ()
        req = Request(
            rid=rid,
            client=rec.client,
            input_ids=prefix + tuple(suffix),
            output_len=rec.output_len,
            arrival_s=float(rec.arrival_s),
            max_new_tokens=rec.max_new_tokens,
            service_class=ServiceClass(rec.service_class),
            ttft_slo_s=DEFAULT_TTFT_SLO_S if rec.ttft_slo_s is None else rec.ttft_slo_s,
            tpot_slo_s=DEFAULT_TPOT_SLO_S if rec.tpot_slo_s is None else rec.tpot_slo_s,
            interaction_id=rec.interaction_id,
            app=rec.app,
            stage=rec.stage,
            prefix_group=rec.prefix_group,
            group_prefix_len=p if rec.prefix_group is not None else None,
        )
        out.append(req)
    return out


def record_of(req: Request) -> TraceRecord:
    """The trace record a request replays from."""
    group, prefix_len = req.prefix_group, req.group_prefix_len
    return TraceRecord(
        arrival_s=req.arrival_s,
        client=req.client,
        input_len=req.input_len,
        output_len=req.output_len,
        prefix_group=group,
        prefix_len=prefix_len,
        max_new_tokens=None if req.max_new_tokens == req.output_len else req.max_new_tokens,
        rid=req.rid,
        service_class=ServiceClass(req.service_class).value,
        interaction_id=req.interaction_id,
        app=req.app,
        stage=req.stage,
        ttft_slo_s=None if req.ttft_slo_s == DEFAULT_TTFT_SLO_S else req.ttft_slo_s,
        tpot_slo_s=None if req.tpot_slo_s == DEFAULT_TPOT_SLO_S else req.tpot_slo_s,
    )


# ---------------------------------------------------------------------------------------------
# JSONL files


def parse_trace_lines(
    lines: Iterable[str],
    *,
    source: str = "<trace>",
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> list[Request]:
    return to_requests(parse_trace_records(lines, source=source), seed=seed, vocab_size=vocab_size)


def load_trace(
    path: str | os.PathLike[str], *, seed: int = 0, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> list[Request]:
    with open(path, encoding="utf-8") as f:
        return parse_trace_lines(f, source=os.fspath(path), seed=seed, vocab_size=vocab_size)


def save_trace(items: Iterable[Request | TraceRecord], path: str | os.PathLike[str]) -> None:
    """Write requests (or records) as JSONL; ``load_trace`` reads them back."""
    with open(path, "w", encoding="utf-8") as f:
        f.write("# sgl-fair trace: one request per line\n")
        for item in items:
            rec = item if isinstance(item, TraceRecord) else record_of(item)
            f.write(json.dumps(rec.to_json_dict()) + "\n")


# ---------------------------------------------------------------------------------------------
# Synthetic clients


@dataclass(frozen=True)
class ClientSpec:
    """One open-loop client. Lengths are distributions (``workloads.lengths``) or plain ints.

    ``prefix_group``: requests start with that group's shared prefix of ``prefix_len``
    tokens (default ``input_len // 2``), capped at ``input_len - 1`` so every prompt keeps
    a token of its own. ``weight`` is the client's fair-share weight, for the policies
    (:func:`client_weights`); generation ignores it.
    """

    client: str
    arrivals: ArrivalProcess
    input_len: LengthDist | int
    output_len: LengthDist | int
    _: KW_ONLY
    weight: float = 1.0
    prefix_group: str | None = None
    prefix_len: int | None = None
    service_class: str = "be"

    def __post_init__(self) -> None:
        if not isinstance(self.client, str) or not self.client:
            raise ValueError("ClientSpec: field 'client' must be a non-empty string")
        if not isinstance(self.arrivals, ArrivalProcess):
            raise ValueError(f"ClientSpec {self.client!r}: field 'arrivals' needs a times() method")
        object.__setattr__(self, "input_len", as_length_dist(self.input_len))
        object.__setattr__(self, "output_len", as_length_dist(self.output_len))
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0 or w == math.inf:
            raise ValueError(f"ClientSpec {self.client!r}: field 'weight' must be > 0 (got {w!r})")
        if self.prefix_len is not None:
            if self.prefix_group is None:
                raise ValueError(
                    f"ClientSpec {self.client!r}: field 'prefix_len' needs a prefix_group"
                )
            try:
                _need_int("prefix_len", self.prefix_len, 0)
            except _FieldError as e:
                raise ValueError(f"ClientSpec {self.client!r}: {e}") from None
        try:
            object.__setattr__(self, "service_class", ServiceClass(self.service_class).value)
        except ValueError:
            raise ValueError(
                f"ClientSpec {self.client!r}: field 'service_class' must be 'rt' or 'be' "
                f"(got {self.service_class!r})"
            ) from None


def client_weights(clients: Sequence[ClientSpec]) -> dict[str, float]:
    """Client -> weight, for weighted policies."""
    out: dict[str, float] = {}
    for spec in clients:
        if out.setdefault(spec.client, spec.weight) != spec.weight:
            raise ValueError(f"client {spec.client!r} is given two different weights")
    return out


def generate_records(
    clients: Sequence[ClientSpec], *, duration_s: float, seed: int = 0
) -> list[TraceRecord]:
    """The clients' requests over ``[0, duration_s)`` as records, sorted by (arrival, client
    order), rids ``f"{client}-{i}"``.

    Spec ``k`` draws arrivals, input lengths and output lengths from three streams seeded by
    ``(seed, k)``, so appending a client, or changing one client's lengths, leaves every
    other stream as it was. Two specs may name the same client (e.g. one per prefix group).
    """
    _check_seed(seed, DEFAULT_VOCAB_SIZE)
    if not (isinstance(duration_s, (int, float)) and math.isfinite(duration_s) and duration_s >= 0):
        raise ValueError(f"duration_s must be a finite number >= 0 (got {duration_s!r})")
    rows = []  # (arrival_s, spec index, j, input_len, output_len): sorts to the output order
    for k, spec in enumerate(clients):
        rng_arrivals, rng_input, rng_output = (
            np.random.default_rng([seed, _TAG_SPEC, k, stream]) for stream in range(3)
        )
        times = spec.arrivals.times(0.0, float(duration_s), rng_arrivals)
        input_lens = spec.input_len.sample(len(times), rng_input).tolist()
        output_lens = spec.output_len.sample(len(times), rng_output).tolist()
        rows.extend(
            (t, k, j, n_in, n_out)
            for j, (t, n_in, n_out) in enumerate(zip(times, input_lens, output_lens, strict=True))
        )
    rows.sort(key=lambda row: row[:3])

    records = []
    counts: dict[str, int] = {}
    for t, k, _, n_in, n_out in rows:
        spec = clients[k]
        prefix_len = None
        if spec.prefix_group is not None:
            wanted = n_in // 2 if spec.prefix_len is None else spec.prefix_len
            prefix_len = min(wanted, n_in - 1)
        i = counts.get(spec.client, 0)
        counts[spec.client] = i + 1
        records.append(
            TraceRecord(
                arrival_s=t,
                client=spec.client,
                input_len=n_in,
                output_len=n_out,
                prefix_group=spec.prefix_group,
                prefix_len=prefix_len,
                rid=f"{spec.client}-{i}",
                service_class=spec.service_class,
            )
        )
    return records


def generate(
    clients: Sequence[ClientSpec],
    *,
    duration_s: float,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> list[Request]:
    """The clients' requests over ``[0, duration_s)``, with token ids (see the module doc)."""
    records = generate_records(clients, duration_s=duration_s, seed=seed)
    return to_requests(records, seed=seed, vocab_size=vocab_size)
