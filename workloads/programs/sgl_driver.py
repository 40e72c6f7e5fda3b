"""The load test's second driver: SGLang frontend programs instead of token-level ones.

::

    clients' arrivals ─▶ frontend_runs ─▶ FrontendDriver.run ─▶ FrontendResult (a HarnessResult)
                                            │ a thread per program run:
                                            │   program.function.run(backend=ClientEndpoint …)
                                            └─ every /generate item ─▶ CallLog ─▶ CallRecord

The frontend interpreter is synchronous, so each program runs on its own thread, started at
its scheduled start; SGLang's executor threads make the calls of its forks in parallel. Start
times are the native driver's (``generate_programs`` over the same clients and seed), so both
drivers offer the same program arrivals. Everything after the calls is the harness's: the
records are ``CallRecord`` s, the result a ``HarnessResult`` whose programs are
:class:`FrontendRun` s (they have the attributes of ``Program`` that the result, the row and
the fairness table read), so ``harness_row``, ``fairness_table`` and the report are unchanged.

Closed loop as the native driver: arrivals stop at ``duration_s``, running programs drain for
up to ``drain_s``; then the run is cut off (:meth:`CallLog.close`): calls not yet sent are
refused, open streams are closed (the server aborts them), and calls still running are
reported ``unfinished``. A non-streamed call in flight at the cut-off runs on in the
background until it ends (at most ``call_timeout_s``): the interpreter cannot cancel it.

Errors are counted, never dropped: a failed call is a ``failed`` record (its error in
``errors()``) and fails its program; a program that fails with no failed call (an error in
the program itself) is reported by ``FrontendResult.errors()`` under its own message.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..harness import HarnessConfig, HarnessResult, HarnessStats
from .sgl_endpoint import CallLog, ClientEndpoint, FrontendCallError
from .sgl_frontend import FrontendProgram, ProgramFailed, make_frontend_program, run_program
from .workloads import ProgramClient, generate_programs

FRONTEND_KINDS = ("tot", "judge")

# How c0 misbehaves in S1 (more calls) and S2 (a longer prefix), after the token-level
# programs' Tab. 3 rows: 4 branches; 16 candidates (16 dimensions); ~2,000 / 600 extra tokens
# of pasted background (in words: the sim's tokenizer makes a word a few tokens).
FRONTEND_MISBEHAVIOUR: Mapping[str, Mapping[str, Mapping[str, Any]]] = {
    "tot": {"s1": {"branches": 4}, "s2": {"context_words": 700}},
    "judge": {"s1": {"num_candidates": 16}, "s2": {"context_words": 200}},
}


@dataclass
class FrontendRun:
    """One program run: the attributes of ``Program`` that the harness's results read
    (``program_id``, ``client``, ``kind``, ``start_s``, ``well_behaved``, ``num_issued``,
    ``done``, ``failed``, ``finish_s``), plus its seed, result and error."""

    program_id: str
    client: str
    kind: str
    start_s: float
    seed: int
    well_behaved: bool = True
    num_issued: int = 0
    finish_s: float | None = None
    failed: bool = False
    error: str | None = None
    result: Any = None

    @property
    def done(self) -> bool:
        return self.finish_s is not None


class FrontendResult(HarnessResult):
    """A frontend run's result; ``errors()`` also counts programs that failed without a
    failed call."""

    def errors(self) -> Counter[str]:
        out = super().errors()
        failed_calls = {c.program_id for c in self.calls if c.state == "failed"}
        for p in self.programs:
            if p.failed and p.program_id not in failed_calls:
                out[f"program failed: {p.error}"] += 1
        return out


def frontend_programs(
    clients: Sequence[ProgramClient], scenario: str | None, params: Mapping[str, Any]
) -> dict[str, FrontendProgram]:
    """Each client's frontend program: its kind with ``params``; a misbehaving client's
    scenario settings first (``params`` override them, as for the token-level programs)."""
    out = {}
    for c in clients:
        if c.kind not in FRONTEND_KINDS:
            kinds = " and ".join(FRONTEND_KINDS)
            raise ValueError(f"the frontend driver runs {kinds} programs, not {c.kind!r}")
        extra = {}
        if not c.well_behaved and scenario is not None:
            extra = FRONTEND_MISBEHAVIOUR[c.kind][scenario]
        out[c.client] = make_frontend_program(c.kind, **{**extra, **params})
    return out


def frontend_runs(
    clients: Sequence[ProgramClient], duration_s: float, *, seed: int = 0
) -> list[FrontendRun]:
    """The runs the clients start in ``[0, duration_s)``: the native driver's start times and
    program ids; each run's seed (its question) is drawn from ``seed`` and its id."""
    bare = [replace(c, params={}) for c in clients]  # start times do not depend on params
    return [
        FrontendRun(
            program_id=p.program_id,
            client=p.client,
            kind=p.kind,
            start_s=p.start_s,
            seed=zlib.crc32(f"{seed}/{p.program_id}".encode()),
            well_behaved=p.well_behaved,
        )
        for p in generate_programs(bare, duration_s, seed=seed)
    ]


class FrontendDriver:
    """Runs ``runs`` (client → program from ``programs``) against ``config.url``.

    ``config`` is the native driver's: ``url``, ``duration_s``, ``drain_s``,
    ``call_timeout_s``, ``connect_timeout_s``, ``api_keys``, ``run_tag`` and ``routing_key``
    apply (``max_connections`` and ``stream_interval`` do not). ``temperature`` is every
    generation's (0: greedy, as the native driver). Construction connects one endpoint per
    client (``EndpointUnreachable`` if the server does not answer).
    """

    def __init__(
        self,
        runs: Sequence[FrontendRun],
        programs: Mapping[str, FrontendProgram],
        config: HarnessConfig,
        *,
        temperature: float = 0.0,
    ) -> None:
        missing = sorted({r.client for r in runs} - set(programs))
        if missing:
            raise ValueError(f"FrontendDriver: no program for client {missing[0]!r}")
        self.runs = sorted(runs, key=lambda r: r.start_s)
        self.programs = dict(programs)
        self.config = config
        self.temperature = temperature
        self.log = CallLog(run_tag=config.run_tag)
        self.stop_event = threading.Event()
        self.cond = threading.Condition()  # guards the runs' fields and num_active
        self.num_active = 0
        self.closed = False
        self.stats = HarnessStats(duration_s=config.duration_s, programs_total=len(self.runs))
        self.endpoints = {
            client: ClientEndpoint(
                config.url,
                client,
                api_key=config.api_keys.get(client),
                timeout_s=config.call_timeout_s,
                connect_timeout_s=config.connect_timeout_s,
                routing_key=config.routing_key,
                log=self.log,
            )
            for client in self.programs
        }

    def stop(self) -> None:
        """Stop issuing and draining now (Ctrl-C); what is running is cut off."""
        self.stop_event.set()
        with self.cond:
            self.cond.notify_all()

    def run(
        self,
        on_update: Callable[[HarnessStats], None] | None = None,
        update_every_s: float = 0.25,
    ) -> FrontendResult:
        started_at = time.time()
        self.log.start_clock()
        now = self.log.now
        ticker = _Ticker(on_update, update_every_s, self._update)
        lag = 0.0
        for run in self.runs:
            while not self.stop_event.is_set() and now() < run.start_s:
                self.stop_event.wait(min(run.start_s - now(), ticker.due_in()))
                ticker.tick()
            if self.stop_event.is_set():
                break
            lag = max(lag, now() - run.start_s)
            self.stats.programs_started += 1
            with self.cond:
                self.num_active += 1
            threading.Thread(
                target=self._run_one, args=(run,), name=f"sgl-{run.program_id}", daemon=True
            ).start()
        self.stats.draining = True
        deadline = max(now(), self.config.duration_s) + self.config.drain_s
        with self.cond:
            while self.num_active and not self.stop_event.is_set() and now() < deadline:
                self.cond.wait(min(deadline - now(), ticker.due_in()))
                ticker.tick()
            t_end = now()
            self.closed = True
            runs = [replace(r) for r in self.runs]
        calls = self.log.close()
        issued = Counter(c.program_id for c in calls)
        for r in runs:
            r.num_issued = issued[r.program_id]
        self.stats.max_loop_lag_s = lag
        ticker.tick(force=True)
        return FrontendResult(
            programs=runs,
            calls=calls,
            t_end_s=t_end,
            started_at=started_at,
            duration_s=self.config.duration_s,
            drain_timeout_s=self.config.drain_s,
            stopped=self.stop_event.is_set(),
            max_loop_lag_s=lag,
        )

    def _run_one(self, run: FrontendRun) -> None:
        program = self.programs[run.client]
        endpoint = self.endpoints[run.client].for_program(
            run.program_id, app=program.kind, start_s=run.start_s
        )
        result, error = None, None
        try:
            result = run_program(program, endpoint, run.seed, temperature=self.temperature)
        except (ProgramFailed, FrontendCallError) as e:
            error = str(e)
        except Exception as e:  # a bug in a program must fail it, visibly, not the run
            error = f"{type(e).__name__}: {e}"
        with self.cond:
            self.num_active -= 1
            self.cond.notify_all()
            if self.closed:
                return
            failed = error is not None or run.program_id in self.log.failed_programs
            run.finish_s, run.failed, run.error, run.result = self.log.now(), failed, error, result
            if failed:
                self.stats.programs_failed += 1
            else:
                self.stats.programs_done += 1

    def _update(self) -> HarnessStats:
        states = self.log.states()
        s = self.stats
        s.elapsed_s = self.log.now()
        s.calls_ok, s.calls_failed, s.calls_in_flight = (
            states["ok"],
            states["failed"],
            states["in_flight"],
        )
        return s


class _Ticker:
    """Calls ``on_update(snapshot())`` every ``every_s`` (when the driver's loop wakes)."""

    def __init__(
        self,
        on_update: Callable[[HarnessStats], None] | None,
        every_s: float,
        snapshot: Callable[[], HarnessStats],
    ) -> None:
        self.on_update, self.every_s, self.snapshot = on_update, every_s, snapshot
        self.next_s = time.monotonic()

    def due_in(self) -> float:
        return max(0.0, self.next_s - time.monotonic()) if self.on_update else self.every_s

    def tick(self, *, force: bool = False) -> None:
        if self.on_update is None or not (force or time.monotonic() >= self.next_s):
            return
        self.next_s = time.monotonic() + self.every_s
        self.on_update(self.snapshot())


def drive_frontend(
    runs: Sequence[FrontendRun],
    programs: Mapping[str, FrontendProgram],
    config: HarnessConfig,
    *,
    on_update: Callable[[HarnessStats], None] | None = None,
    temperature: float = 0.0,
) -> FrontendResult:
    """``FrontendDriver(...).run(on_update)`` in one call."""
    return FrontendDriver(runs, programs, config, temperature=temperature).run(on_update)
