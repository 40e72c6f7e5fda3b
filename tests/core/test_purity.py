"""The core (sgl_fair/) imports neither torch nor sglang: proven in a clean interpreter."""

import subprocess
import sys

SCRIPT = r"""
import importlib, pkgutil, sys
sys.modules['torch'] = None      # any `import torch` now raises ImportError
sys.modules['sglang'] = None
sys.modules['triton'] = None
import sgl_fair
names = [m.name for m in pkgutil.walk_packages(sgl_fair.__path__, 'sgl_fair.')]
for name in names:
    importlib.import_module(name)
# The pure parts of the worker and workloads too: the scheduler and simulator run anywhere.
for name in ('sgl_fair.worker.scheduler', 'sgl_fair.worker.sim.runner',
             'sgl_fair.experiment.single', 'sgl_fair.experiment.vtc',
             'sgl_fair.workloads.report'):
    importlib.import_module(name)
assert 'torch' not in sys.modules or sys.modules['torch'] is None
print(len(names))
"""


def test_core_imports_without_torch_or_sglang():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) >= 10  # really walked the package


def test_blocking_works():
    """The check above can fail: a module importing torch is caught."""
    code = "import sys; sys.modules['torch'] = None; import torch"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0 and "import of torch halted" in out.stderr
