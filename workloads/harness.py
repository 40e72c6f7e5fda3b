"""Live load generator: plays the programs' calls against an SGLang-compatible HTTP server.

The simulated experiments (``cluster_runs``) drive programs through a virtual cluster; this
module drives the *same* programs through a real server, so a live run and a simulated run of
one workload are measured by the same code (``harness_report``: ``metrics.summarize``, the
cluster row fields)::

    workload(...) ─▶ generate_programs ─▶ drive(programs, HarnessConfig) ─▶ HarnessResult
                                                                             │ records()/events()
                                                   harness_row / fairness_table ◀┘

Closed loop, as the simulator: a program starts at its ``start_s`` (wall-clock seconds from
the run's start), its root calls are sent then; a child call is built only when all its
parents finished, from their *actual* output ids (``req.output_ids`` is set before
``program.on_finished``), and a call with ``arrival_s`` in the future (a chat user's think
time) waits until then. How one call goes over the wire, and what is recorded of it, is
``loadclient``'s.

Failures are counted, never dropped: a non-2xx status, an ``abort`` finish, a server error
chunk, a short output, a transport error or a timeout fails the call (``state = "failed"``,
the record ``rejected`` with the error as ``reject_reason``) and ``program.on_failed`` stops
its program. Arrivals stop at ``duration_s``; in-flight programs then drain for up to
``drain_timeout_s`` and whatever is left is cancelled and reported as unfinished (a
cancelled stream makes SGLang abort the request server-side).

Times are ``loop.time()`` (monotonic) relative to the run's start; ``arrival_s`` is when the
program wanted the call sent, ``send_s`` when it was (their gap is the harness's own lag,
reported as ``max_send_lag_s``, so an overloaded load generator is visible rather than
silently lowering the offered load).
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from sgl_fair.records import RequestRecord, ServiceEvent
from sgl_fair.request import Request

# apply_chunk is not used here: the SGLang-frontend endpoint (programs/sgl_endpoint.py)
# imports it from this module.
from .loadclient import CallFailed, CallRecord, apply_chunk, open_session, send_call  # noqa: F401
from .programs import BASE_RATE_PER_S, Program, ProgramClient, workload


def default_drain_timeout(duration_s: float) -> float:
    """Long enough for programs started near the end to finish at a normal load (a ToT tree
    is several sequential calls), without letting an overloaded server stall the run for as
    long as it ran again many times over."""
    return max(30.0, float(duration_s))


@dataclass(frozen=True)
class HarnessConfig:
    """How to drive one endpoint.

    ``api_keys``: client id → API key, sent as ``Authorization: Bearer``. ``run_tag``
    prefixes every wire ``rid`` (``f"{run_tag}-{rid}"``) so runs against one long-lived server
    never reuse an id; empty draws one. ``max_connections`` 0 means no pool limit (closed-loop
    programs need one connection per in-flight call; a cap would queue calls in the client
    and hide the server's scheduling). ``stream_interval``: SGLang's sampling parameter (a
    chunk every N tokens; the server's default when None): one Python client parses ~10k
    chunks/s per core, so a large fleet streaming every token can saturate it (watch
    ``max_loop_lag_s``).
    """

    url: str
    duration_s: float
    drain_timeout_s: float | None = None
    call_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    api_keys: Mapping[str, str] = field(default_factory=dict)
    run_tag: str = ""
    routing_key: bool = True
    max_connections: int = 0
    stream_interval: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", self.url.rstrip("/"))
        if not self.run_tag:
            object.__setattr__(self, "run_tag", f"lt{int(time.time())}{secrets.token_hex(2)}")
        for name in ("duration_s", "call_timeout_s", "connect_timeout_s"):
            _need_positive(name, getattr(self, name))
        if self.drain_timeout_s is not None:
            _need_positive("drain_timeout_s", self.drain_timeout_s, allow_zero=True)
        si = self.stream_interval
        if si is not None and (isinstance(si, bool) or not isinstance(si, int) or si < 1):
            raise ValueError(f"field 'stream_interval' must be an integer >= 1 (got {si!r})")

    @property
    def drain_s(self) -> float:
        if self.drain_timeout_s is None:
            return default_drain_timeout(self.duration_s)
        return float(self.drain_timeout_s)


def _need_positive(name: str, value: Any, *, allow_zero: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"field {name!r} must be a number {'>=' if allow_zero else '>'} 0")


# ---------------------------------------------------------------------------------------------
# The run


@dataclass
class HarnessStats:
    """A progress snapshot (what the CLI's progress bar shows)."""

    elapsed_s: float = 0.0
    duration_s: float = 0.0
    draining: bool = False
    programs_total: int = 0
    programs_started: int = 0
    programs_done: int = 0
    programs_failed: int = 0
    calls_ok: int = 0
    calls_failed: int = 0
    calls_in_flight: int = 0
    max_loop_lag_s: float = 0.0


@dataclass
class HarnessResult:
    """A finished run: the programs (their state at the end), every issued call, the end.

    ``t_end_s``: when the run stopped (everything drained, or the cut-off), relative to the
    start; ``started_at``: the start as a Unix time; ``stopped``: cut short by ``stop()``
    (Ctrl-C) rather than by the drain timeout or completion. ``max_loop_lag_s``: the
    longest the harness's event loop was late to a timer; beyond ~0.1 s the client was
    CPU-bound and every time it recorded is late by up to that much.
    """

    programs: list[Program]
    calls: list[CallRecord]
    t_end_s: float
    started_at: float
    duration_s: float
    drain_timeout_s: float
    stopped: bool = False
    max_loop_lag_s: float = 0.0

    @property
    def sent(self) -> list[CallRecord]:
        return [c for c in self.calls if c.send_s is not None]

    def records(self) -> list[RequestRecord]:
        return [c.record() for c in self.sent]

    def events(self) -> list[ServiceEvent]:
        evs = [e for c in self.calls for e in c.events()]
        evs.sort(key=lambda e: e.t_s)
        return evs

    def count(self, state: str) -> int:
        return sum(c.state == state for c in self.calls)

    @property
    def started_programs(self) -> list[Program]:
        return [p for p in self.programs if p.num_issued > 0]

    @property
    def latency_programs(self) -> list[Program]:
        """The programs latency percentiles are over: started and not failed. A failed
        program has no latency (it is counted as failed), as a failed call has no TTFT;
        one still running at the cut-off counts with its age then (a lower bound)."""
        return [p for p in self.programs if p.num_issued > 0 and not p.failed]

    def errors(self) -> Counter[str]:
        return Counter(c.error or "?" for c in self.calls if c.state == "failed")


class _Run:
    """The event-loop side of ``drive``: one task per call; all program state is touched only
    from the loop's thread, so the programs need no locks."""

    def __init__(
        self,
        programs: Sequence[Program],
        config: HarnessConfig,
        session: aiohttp.ClientSession,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.programs = list(programs)
        self.config = config
        self.session = session
        self.calls: list[CallRecord] = []
        self.tasks: set[asyncio.Task] = set()
        self.stats = HarnessStats(duration_s=config.duration_s, programs_total=len(self.programs))
        self.stop_event = asyncio.Event()
        self.idle = asyncio.Event()  # set whenever no call task is left
        self.t0 = self.loop.time()

    def now(self) -> float:
        return self.loop.time() - self.t0

    # ---- issuing ----

    def _spawn(self, prog: Program, req: Request) -> None:
        node = req.rid.split("/", 1)[1] if "/" in req.rid else req.rid
        rec = CallRecord(
            rid=req.rid,
            wire_rid=f"{self.config.run_tag}-{req.rid}",
            client=req.client,
            program_id=prog.program_id,
            node=node,
            app=req.app or prog.kind,
            stage=req.stage,
            input_len=req.input_len,
            max_new_tokens=int(req.max_new_tokens or req.output_len),
            arrival_s=req.arrival_s,
        )
        self.calls.append(rec)
        task = self.loop.create_task(self._call(prog, req, rec))
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not self.tasks:
            self.idle.set()

    async def _launch(self) -> None:
        for prog in self.programs:
            if self.stop_event.is_set():
                return
            delay = prog.start_s - self.now()
            if delay > 0 and await self._sleep_or_stop(delay):
                return
            self.stats.programs_started += 1
            # The scheduled start, not "now": a lagging harness shows up as latency.
            for req in prog.start(prog.start_s):
                self._spawn(prog, req)

    async def _sleep_or_stop(self, delay: float) -> bool:
        """Sleep ``delay`` seconds; True if ``stop()`` came first."""
        try:
            await asyncio.wait_for(self.stop_event.wait(), delay)
        except asyncio.TimeoutError:
            return False
        return True

    # ---- one call ----

    async def _call(self, prog: Program, req: Request, rec: CallRecord) -> None:
        wait = req.arrival_s - self.now()
        if wait > 0:
            await asyncio.sleep(wait)  # a cancellation here leaves it "unsent"
        rec.send_s = self.now()
        rec.state = "in_flight"
        self.stats.calls_in_flight += 1
        error: str | None = None
        try:
            await send_call(
                self.session,
                self.config.url,
                req,
                rec,
                self.now,
                api_key=self.config.api_keys.get(req.client),
                routing_key=self.config.routing_key,
                stream_interval=self.config.stream_interval,
            )
        except asyncio.CancelledError:
            rec.state = "unfinished"
            raise
        except CallFailed as e:
            error = str(e)
        except asyncio.TimeoutError:
            error = f"timeout: no complete response within {self.config.call_timeout_s:g} s"
        except aiohttp.ClientError as e:
            error = f"transport error: {type(e).__name__}: {e}"
        except Exception as e:  # a malformed response must fail the call, not the run
            error = f"{type(e).__name__}: {e}"
        finally:
            self.stats.calls_in_flight -= 1
        if error is None and len(rec.output_ids) != req.output_len:
            if rec.completion_tokens and not rec.output_ids:
                error = f"the response carries no output_ids ({rec.completion_tokens} tokens)"
            else:
                error = (
                    f"short output: {len(rec.output_ids)} of {req.output_len} tokens "
                    f"(finish_reason {rec.finish_reason})"
                )
        now = self.now()
        if error is not None:
            rec.state, rec.error, rec.failed_s = "failed", error, now
            rec.finish_s = None
            self.stats.calls_failed += 1
            prog.on_failed(req, now)
            if prog.done:
                self.stats.programs_failed += 1
            return
        rec.state = "ok"
        self.stats.calls_ok += 1
        req.output_ids = list(rec.output_ids)  # children's prompts are built from these
        children = prog.on_finished(req, now)
        if prog.done:
            if prog.failed:
                self.stats.programs_failed += 1
            else:
                self.stats.programs_done += 1
        for child in children:
            self._spawn(prog, child)

    # ---- the whole run ----

    def stop(self) -> None:
        """Stop issuing and draining now (Ctrl-C): what is in flight is cancelled."""
        self.stop_event.set()

    async def _ticker(
        self, on_update: Callable[[HarnessStats], None] | None, every_s: float
    ) -> None:
        """Progress updates, and the loop's lag: how late a timer fires."""
        while True:
            self.stats.elapsed_s = self.now()
            if on_update is not None:
                on_update(self.stats)
            due = self.loop.time() + every_s
            await asyncio.sleep(every_s)
            lag = self.loop.time() - due
            self.stats.max_loop_lag_s = max(self.stats.max_loop_lag_s, lag)

    async def run(
        self, on_update: Callable[[HarnessStats], None] | None, update_every_s: float
    ) -> float:
        ticker = self.loop.create_task(self._ticker(on_update, update_every_s))
        try:
            await self._launch()
            deadline = max(self.now(), self.config.duration_s) + self.config.drain_s
            self.stats.draining = True
            # A child joins `tasks` before its parent's task ends, so once the launcher is done
            # `tasks` empties only when every started program is done.
            if self.tasks and not self.stop_event.is_set():
                self.idle.clear()
                waiters = {
                    self.loop.create_task(self.idle.wait()),
                    self.loop.create_task(self.stop_event.wait()),
                }
                left = max(0.0, deadline - self.now())
                await asyncio.wait(waiters, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                for w in waiters:
                    w.cancel()
            t_end = self.now()
            for task in list(self.tasks):
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            return t_end
        finally:
            ticker.cancel()
            self.stats.elapsed_s = self.now()
            if on_update is not None:
                on_update(self.stats)


async def drive(
    programs: Sequence[Program],
    config: HarnessConfig,
    *,
    on_update: Callable[[HarnessStats], None] | None = None,
    update_every_s: float = 0.25,
    on_start: Callable[[Callable[[], None]], None] | None = None,
) -> HarnessResult:
    """Run ``programs`` (start times relative to now) against ``config.url``.

    ``on_update`` gets a ``HarnessStats`` every ``update_every_s``; ``on_start`` gets a
    ``stop()`` callable (e.g. to wire Ctrl-C to a clean cut-off that still reports).
    """
    for p in programs:
        if p.num_issued:
            raise ValueError(f"program {p.program_id!r} was already started")
    programs = sorted(programs, key=lambda p: p.start_s)
    async with open_session(
        max_connections=config.max_connections,
        call_timeout_s=config.call_timeout_s,
        connect_timeout_s=config.connect_timeout_s,
    ) as session:
        run = _Run(programs, config, session)
        if on_start is not None:
            on_start(run.stop)
        started_at = time.time()
        t_end = await run.run(on_update, update_every_s)
    return HarnessResult(
        programs=programs,
        calls=run.calls,
        t_end_s=t_end,
        started_at=started_at,
        duration_s=config.duration_s,
        drain_timeout_s=config.drain_s,
        stopped=run.stop_event.is_set(),
        max_loop_lag_s=run.stats.max_loop_lag_s,
    )


# ---------------------------------------------------------------------------------------------
# Workload clients at a given rate


def build_clients(
    name: str,
    scenario: str | None,
    *,
    num_clients: int,
    duration_s: float,
    dp: int = 1,
    rate_scale: float = 1.0,
    rate: float | None = None,
    params: Mapping[str, Any] | None = None,
) -> list[ProgramClient]:
    """``workload(...)``'s clients; ``rate`` (programs/s for a normal client) replaces
    ``BASE_RATE_PER_S[kind] × dp × rate_scale``, the scenario's misbehaver factors still
    applying on top. Built by asking ``workload`` per program kind for the ``rate_scale``
    that gives that kind ``rate`` (``mixed`` has one base rate per kind), so every other
    choice (arrival process, cv, misbehaviour) stays ``workload``'s. ``params`` override
    every client's program parameters (as ``RunSpec.params``)."""
    kw = {"num_clients": num_clients, "duration_s": duration_s}
    if rate is None:
        clients = workload(name, scenario, dp=dp, rate_scale=rate_scale, **kw)
    else:
        _need_positive("rate", rate)
        base = workload(name, scenario, **kw)
        clients = list(base)
        for kind in {c.kind for c in base}:
            scaled = workload(name, scenario, rate_scale=rate / BASE_RATE_PER_S[kind], **kw)
            for i, c in enumerate(scaled):
                if c.kind == kind:
                    clients[i] = c
    if params:
        clients = [replace(c, params={**c.params, **params}) for c in clients]
    return clients
