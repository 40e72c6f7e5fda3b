"""``python -m sgl_fair.experiment``: the papers' experiments on the simulator, in virtual time.

A command-line app (the top layer): it composes the worker's scheduler and simulated engine,
the router and the workloads. ``single`` holds the one-worker experiments, ``cluster`` and
``cluster_runs`` the multi-worker (router + workers) ones, ``cli`` the command line.
"""

from sgl_fair.experiment.cli import main

__all__ = ["main"]
