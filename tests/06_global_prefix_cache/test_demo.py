"""`python -m global_prefix_cache demo` (small sizes): both layers, every check passes."""
import pytest

from global_prefix_cache.__main__ import main

SMALL = ["--system-tokens", "48", "--block-size", "4", "--num-blocks", "40", "--ms-per-token", "0"]


@pytest.mark.parametrize("layer", [[], ["--mooncake"]], ids=["embedded", "mooncake"])
def test_demo_runs_and_checks_pass(layer, capsys):
    assert main(["demo", *SMALL, *layer]) == 0
    out = capsys.readouterr().out
    assert "remote hit 48 tokens" in out and "== one node doing both: OK" in out and "all checks passed" in out


def test_demo_rejects_sizes_that_do_not_fit():
    with pytest.raises(SystemExit):
        main(["demo", "--system-tokens", "4000", "--num-blocks", "8"])
