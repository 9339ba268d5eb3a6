"""The chapter's walkthrough notebook executes top to bottom within its budget, and its checks hold."""
import pytest

from notebook_runner import run_notebook


@pytest.mark.notebook
@pytest.mark.model
def test_notebook_runs():
    nb = run_notebook("08_structured_output", budget_s=90)
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "DFA agrees with re.fullmatch on 500 random strings: True" in outputs
    assert "sampled document validates: True" in outputs
    assert "a document without the required 'born' is accepted: False" in outputs
    assert "every token of the document was allowed at its step: True" in outputs
    assert "allowed = ['<|im_end|>']" in outputs          # after the document: EOS and nothing else
    assert "stack depth returns to the root at the end: True" in outputs
    assert "a bracket closed by the wrong kind is refused: True" in outputs
    assert "split mask equals plain mask: True" in outputs
    assert "all backends agree: True" in outputs
