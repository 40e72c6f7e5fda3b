"""CPU TEST SHIM: runs at start-up in every process of a test's SGLang server (its scheduler
and detokenizer are spawned, so an import in the parent is not enough). It installs the
torchvision import stub (``tests/sglang/cpu_stubs.py``, also on the path) before anything
imports sglang. Only the ``sglang_server`` tests put this folder on ``PYTHONPATH``."""

import cpu_stubs

cpu_stubs.install()
