"""CPU TEST SHIM, never on a GPU path: the one vLLM op SGLang 0.5.23 imports off CUDA.

Only the ``sglang_server`` tests put ``tests/sglang/cpu_shim`` on a server's ``PYTHONPATH``
(``tests/sglang/live_rig.py``); a GPU install has SGLang's own kernels and never sees it.
"""
