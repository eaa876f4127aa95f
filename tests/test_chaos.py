"""The chaos benchmark's schedule and summary helpers, checked by ``python -m benchmarks.chaos --self-check`` (a
subprocess: tests never import benchmarks; the benchmark itself is too slow for the test gate)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_chaos_schedule_and_summary_helpers_hold_on_fixed_inputs():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.chaos", "--self-check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "[chaos] self-check passed" in proc.stdout, proc.stdout + proc.stderr
