"""Suite-wide: tests marked ``gpu`` run only where a CUDA GPU is visible."""

from __future__ import annotations

import pytest

from sgl_fair.launch import gpu_visible


def pytest_collection_modifyitems(config, items):
    if gpu_visible():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
