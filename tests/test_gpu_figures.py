"""benchmarks/gpu_figures.py, the figures benchmarks/gpu_check.sh gathers on a GPU, run as a user
runs it (conftest.run_script) at its small CPU shapes: one attention case that fails is recorded
with its error, and its section keeps every other case's figures."""
import json
from pathlib import Path

from conftest import run_script

REPO = Path(__file__).resolve().parents[1]
GPU_FIGURES = REPO / "benchmarks" / "gpu_figures.py"

# Before the script runs: model.attend fails on every call with 4 new tokens (one call shape).
BREAK_ONE_SHAPE = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
import model
attend = model.attend
def failing(q, k, v, mask):
    if q.shape[2] == 4:
        raise RuntimeError("this kernel failed")
    return attend(q, k, v, mask)
model.attend = failing
"""


def test_a_failing_kernel_case_leaves_the_other_cases_of_its_section(tmp_path):
    out = tmp_path / "kernels.json"
    line = ["kernels", "--device", "cpu", "--small", "--threads", "1", "--json", str(out)]
    [done] = run_script(GPU_FIGURES, line, prelude=BREAK_ONE_SHAPE)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(out.read_text())
    cases = figures["cases"]
    [failed] = figures["failed"]
    assert "batch 1, 4 new tokens" in failed
    assert cases[failed] == {"error": "RuntimeError: this kernel failed"}
    others = [case for name, case in cases.items() if name != failed]
    assert len(others) == 5
    assert all(case["kernels"] and case["ms"] > 0 for case in others)
