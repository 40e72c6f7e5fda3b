"""The SGLang plugin's CPU tests: real sglang 0.5.23 modules, no GPU.

They need the environment ``make sglang-cpu`` builds (``make test`` builds it first and sets
``SGLFAIR_REQUIRE_SGLANG=1``, so in CI a missing sglang fails instead of skipping).
"""

from __future__ import annotations

import importlib.util
import os

import cpu_stubs  # tests/sglang/ is on sys.path (pytest rootdir-relative imports)
import pytest

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None

if HAVE_SGLANG:
    cpu_stubs.install()
elif os.environ.get("SGLFAIR_REQUIRE_SGLANG") == "1":
    raise pytest.UsageError(
        "SGLFAIR_REQUIRE_SGLANG=1 but sglang is not installed: run `make sglang-cpu`"
    )


def pytest_collection_modifyitems(config, items):
    if HAVE_SGLANG:
        return
    skip = pytest.mark.skip(reason="sglang is not installed (make sglang-cpu builds it)")
    for item in items:
        if "tests/sglang/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)
