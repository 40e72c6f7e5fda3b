"""Optional dependencies of a test module: skip it when they are missing, except in CI.

``require("torch", "triton")`` at the top of a module, before importing them. Missing
modules skip the module with the install hint — unless ``SGLFAIR_REQUIRE_SGLANG=1`` (CI, which
installs every extra), where a missing one fails the run instead of silently skipping it.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

HINT = "pip install -e '.[kernels]'"


def require(*modules: str, hint: str = HINT) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return
    msg = f"{', '.join(missing)} not installed ({hint})"
    if os.environ.get("SGLFAIR_REQUIRE_SGLANG") == "1":
        pytest.fail(f"SGLFAIR_REQUIRE_SGLANG=1 but {msg}", pytrace=False)
    pytest.skip(msg, allow_module_level=True)
