"""eagle3ft.drafter stands alone: importing it (every module of it) loads no stage (data, train, eval, targets)."""

import subprocess
import sys

STAGES = ("eagle3ft.data", "eagle3ft.train", "eagle3ft.eval", "eagle3ft.targets")
MODULES = ("config", "vocab", "model", "model_mla", "wgrad", "export", "folder")


def test_drafter_package_imports_no_stage():
    code = (
        "import importlib, sys\n"
        f"for m in {MODULES!r}:\n"
        "    importlib.import_module('eagle3ft.drafter.' + m)\n"
        f"print('\\n'.join(sorted(m for m in sys.modules if m.startswith({STAGES!r}))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "", f"importing eagle3ft.drafter loaded stage modules: {out.split()}"
