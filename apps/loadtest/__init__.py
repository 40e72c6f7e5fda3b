"""``python -m sgl_fair.loadtest`` — drive a live SGLang-compatible server with a workload.

    python -m sgl_fair.loadtest --url URL --workload tot|judge|longqa|chat|mixed
        --scenario s1|s2|none --clients N|NAME,NAME,... --duration S [--rate R]
        [--rate-scale X] [--dp D] [--seed N] [--api-key-file F] [--out DIR] [--json]
        [--no-progress] [--param KEY=VALUE ...] [--drain-timeout S] [--call-timeout S]
        [--stream-interval N] [--driver native|sglang-frontend]

The same programs the simulated experiments run (``workloads.programs``), sent closed-loop
by ``workloads.harness`` to ``URL/generate``; the run is measured by the same code as the
simulated rows, so a live ``results.json`` row compares field by field with a simulated one.

``--clients`` is a number (clients ``c0, c1, …``) or their names (``alice,bob``: the first
is ``c0``, the scenario's misbehaver). ``--driver sglang-frontend`` runs the SGLang frontend
programs instead (``workloads.programs.sgl_frontend``: ``tot`` and ``judge`` written with
``@sgl.function``, through ``RuntimeEndpoint``; needs sglang installed), at the same arrival
times, measured by the same code; ``--param`` then sets their parameters (``branches``,
``depth``, ``num_candidates``, ``max_tokens``, ``context_words``, ``given_answers``).

Rates: by default each client sends ``BASE_RATE_PER_S[kind] × dp × rate_scale`` programs
per second, ``dp`` being the server's ``dp_size`` (from ``GET /server_info``) unless given;
``--rate R`` sets a normal client's rate outright (the scenario's misbehaver still sends
its multiple of it). ``--param`` overrides a program parameter for every client (e.g.
``--param document_len=2000`` for a model with a short context).

Prints the fairness table (``--json``: the results JSON) and writes to ``--out`` (default
``runs/loadtest-<timestamp>``): ``requests.jsonl`` (every call as observed),
``results.json`` (the row, the per-client table, the run's metadata), ``report.md`` and
``timeline.png``. Exit status: 0 for a completed run (failed calls are reported, not
fatal), 1 if no call succeeded, 2 for bad input or an unreachable server (one line).

The app's files: ``config`` (settings, validation, the one-line error), ``run`` (probe, drive,
results), ``output`` (tables, progress bar, the files in ``--out``), ``cli`` (flags, exit
status); this module re-exports what other apps and the tests use.
"""

from .cli import main
from .config import FRONTEND, NATIVE, LoadTestConfig, LoadTestError
from .output import print_fairness, progress_bar
from .run import run_loadtest

__all__ = [
    "FRONTEND",
    "NATIVE",
    "LoadTestConfig",
    "LoadTestError",
    "main",
    "print_fairness",
    "progress_bar",
    "run_loadtest",
]
