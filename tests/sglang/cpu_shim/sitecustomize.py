"""CPU TEST SHIM: runs at start-up in every process of an SGLang server on this CPU (its
scheduler and detokenizer are spawned, so an import in the parent is not enough). It installs
the torchvision import stub (``tests/sglang/cpu_stubs.py``, also on the path) before anything
imports sglang. On the path of every SGLang server started on a CPU-only machine, and only
there: the ``sglang_server`` tests (``live_rig.server_env``), ``make demo-sglang``, and the
benches that start servers here (``bench/bench_sglang_live.py``,
``bench/bench_sglang_side_by_side.py``, through ``live_rig``). Never on a GPU path."""

import cpu_stubs

cpu_stubs.install()
