"""sgl-fair: fair, locality-aware scheduling for multi-tenant LLM serving.

The package root is the pure core: no torch and no sglang import anywhere below
``sgl_fair/`` (tests/core/test_purity.py proves it). The router, worker, kernels
and workloads live in their own top-level folders and install as subpackages.
"""

__version__ = "0.1.0"
