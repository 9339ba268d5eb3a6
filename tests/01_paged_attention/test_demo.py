"""The chapter's demo (`python -m paged_attention`) runs and reports equality and waste."""
import subprocess
import sys


def test_demo_runs_and_reports_equality_and_waste():
    proc = subprocess.run([sys.executable, "-m", "paged_attention"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "paged decode attention vs dense attention" in proc.stdout
    err = float(proc.stdout.split("max |diff| = ")[1].split()[0])
    assert err < 1e-5
    assert "paging (vLLM)" in proc.stdout
