"""The chapter's walkthrough notebook executes top to bottom within its budget, and its checks hold.
(A tiny random Llama and PEFT adapters made in the notebook: no model download.)"""
import pytest

from notebook_runner import run_notebook


@pytest.mark.notebook
def test_notebook_runs():
    nb = run_notebook("09_lora", budget_s=90)
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "30 layers                106,168,320    2,442,240      2.30%" in outputs     # SmolLM2, r = 8
    assert "one segment per slot      (sort=True):  [(-1, [6, 7, 8, 9, 14]), (0, [0, 1, 2, 3, 4, 5, 11])" in outputs
    assert "shrink + expand == per-token formula: True" in outputs
    assert "shrink + expand == merged weight: True" in outputs
    assert "tokens with -1 keep the base output bit for bit: True" in outputs
    assert "all backends agree: True" in outputs
    assert "BGMV and SGMV forced on the same step agree: True" in outputs
    assert "mixed batch equals PEFT per adapter: True" in outputs
    assert "the same step with add_lora_linear as the layers' delta: True" in outputs
    assert "adapter 3 -> slot 1; slots {0: 1, 1: 3}" in outputs                          # 2 evicted, not 1
    assert "the pinned adapter was never evicted: True" in outputs
    assert "AllSlotsPinnedError" in outputs
    assert "as PEFT does: True" in outputs
