"""What SGLang 0.5.23 needs to import on a CPU-only test machine beyond requirements/sglang-cpu.txt.

PyPI has no CPU build of torchvision that imports beside the CPU torch, yet sglang's model
configs import it (``import torchvision.transforms as T``) at module level. The scheduler,
policy and radix-cache code never calls it, so an import hook serves ``torchvision`` and its
submodules as empty stubs; calling anything from them raises. Installed only when no real
torchvision is importable (a GPU install has one).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

STUBBED = ("torchvision",)


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubAttr(f"{self.__name__}.{name}")


class _StubAttr:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubAttr(f"{self._name}.{name}")

    def __call__(self, *args: object, **kwargs: object) -> object:
        raise RuntimeError(f"{self._name} is a CPU-test stub (torchvision is not installed)")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if fullname.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+cpu-test-stub"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install() -> bool:
    """Install the stubs unless the real packages exist; True when installed."""
    if any(isinstance(f, _StubFinder) for f in sys.meta_path):
        return True
    if importlib.util.find_spec("torchvision") is not None:
        return False
    sys.meta_path.insert(0, _StubFinder())
    return True
