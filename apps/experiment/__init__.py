"""``python -m sgl_fair.experiment``: the papers' experiments on the simulator, in virtual time.

A command-line app (the top layer): it composes the worker's scheduler and simulated engine,
the router and the workloads. ``single`` runs the one-worker experiments (``vtc``: the VTC
paper's figures; ``bros`` and ``fairserve``: their papers'); the multi-worker (router +
workers) ones are in ``cluster_grid``, ``cluster_sweeps`` and ``cluster_timelines``,
registered by ``cluster`` (``cluster_base``: their shared shape, ``cluster_runs``: one run);
``report`` writes the outputs and ``cli`` is the command line.
"""

from sgl_fair.experiment.cli import main

__all__ = ["main"]
