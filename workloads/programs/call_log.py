"""The frontend programs' call log: every ``/generate`` item a ``ClientEndpoint`` sent, as the
load-test harness's ``CallRecord`` s, and the errors a call ends with. No sglang import:
``sgl_endpoint.py`` (the endpoint) fills the log and re-exports these names."""

from __future__ import annotations

import contextlib
import copy
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import requests

from ..loadclient import CallRecord


class FrontendCallError(RuntimeError):
    """An HTTP call of a frontend program failed (message: why, in one line; ``status``:
    the HTTP status when the server answered with an error)."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class EndpointUnreachable(FrontendCallError):
    """The server did not answer ``/get_model_info``."""


class CallLog:
    """Every ``/generate`` item the endpoints sent, as harness ``CallRecord`` s (thread-safe).

    Times are seconds since the log was made (``clock``: monotonic). Records are changed only
    under ``lock``; :meth:`close` cuts the run off: later calls are refused, streams still
    open are closed (the server aborts them), and the records are returned as they were then.
    """

    def __init__(self, *, run_tag: str = "", clock: Callable[[], float] = time.monotonic):
        self.lock = threading.Lock()
        self.run_tag = run_tag or f"fe{int(time.time())}{secrets.token_hex(2)}"
        self._clock = clock
        self.t0 = clock()
        self.calls: list[CallRecord] = []
        self.failed_programs: set[str] = set()  # program ids with a failed call
        self.closed = False
        self._streams: set[requests.Response] = set()

    def now(self) -> float:
        return self._clock() - self.t0

    def start_clock(self) -> None:
        """Count times from now (a driver's start, after its endpoints connected)."""
        with self.lock:
            if self.calls:
                raise RuntimeError("CallLog.start_clock: calls were already recorded")
            self.t0 = self._clock()

    def begin(self, template: CallRecord, num_items: int, max_new: list[int]) -> list[CallRecord]:
        """Records for one request's items, sent now (refused once closed)."""
        with self.lock:
            if self.closed:
                raise FrontendCallError("the run was cut off before this call was sent")
            now = self.now()
            recs = []
            for i in range(num_items):
                suffix = f".{i}" if num_items > 1 else ""
                rec = copy.copy(template)
                rec.rid, rec.wire_rid = template.rid + suffix, template.wire_rid + suffix
                rec.node += suffix
                rec.max_new_tokens = max_new[i]
                rec.arrival_s = min(template.arrival_s, now)
                rec.send_s, rec.state = now, "in_flight"
                rec.chunk_s, rec.chunk_tokens, rec.output_ids = [], [], []
                recs.append(rec)
            self.calls.extend(recs)
            return recs

    def open_stream(self, resp: requests.Response) -> None:
        with self.lock:
            if self.closed:
                resp.close()
                raise FrontendCallError("the run was cut off during this call")
            self._streams.add(resp)

    def close_stream(self, resp: requests.Response) -> None:
        with self.lock:
            self._streams.discard(resp)
        resp.close()

    def close(self) -> list[CallRecord]:
        """Cut off: a snapshot of the records, calls still running marked ``unfinished``."""
        with self.lock:
            self.closed = True
            streams, self._streams = list(self._streams), set()
            calls = copy.deepcopy(self.calls)
        for resp in streams:
            with contextlib.suppress(Exception):
                resp.close()
        for rec in calls:
            if rec.state == "in_flight":
                rec.state = "unfinished"
        return calls

    def states(self, program_id: str | None = None) -> Counter[str]:
        with self.lock:
            return Counter(
                c.state for c in self.calls if program_id is None or c.program_id == program_id
            )


def call_kind(node: str) -> str:
    """What made a record's call: ``"003-select.choices.1"`` → ``"select.choices"``."""
    kind = node.split("-", 1)[-1]
    head, _, last = kind.rpartition(".")
    return head if last.isdigit() else kind


def requests_by_kind(calls: Iterable[Any]) -> Counter[str]:
    """HTTP requests by kind: the items of one batch (a select's choices) are one request.
    ``calls``: records (anything with ``program_id`` and ``node``)."""
    requests = {(c.program_id, c.node.split("-", 1)[0]): call_kind(c.node) for c in calls}
    return Counter(requests.values())
