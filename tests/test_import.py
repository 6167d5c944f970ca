"""`import ghostdp` does no heavy work: no integration's library and no scipy module is imported until used
(scipy.signal and scipy.special alone took ~1.3 s). tests/accounting/test_accountants.py runs the code that imports them."""
import subprocess
import sys


def test_importing_ghostdp_imports_no_heavy_module():
    heavy = ("transformers", "peft", "accelerate", "lightning", "opacus", "scipy.signal", "scipy.special")
    code = f"import sys, ghostdp; print([m for m in {heavy!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr

