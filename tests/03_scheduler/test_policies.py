"""The policies' trade-offs, measured in the simulator [Kwon 2025, §4.5]: SRTF removes
head-of-line blocking but starves long prompts; two-level scheduling bounds the starvation;
priority serves high-priority requests first. Each claim is an inequality with a margin."""
import pytest

from scheduler.experiments import policy_comparison


@pytest.fixture(scope="module")
def rows():
    return {(r["trace"], r["policy"]): r for r in policy_comparison()}


def test_srtf_removes_head_of_line_blocking(rows):
    fcfs, srtf, two = (rows["hol_blocking", p] for p in ("fcfs", "srtf", "two_level"))
    assert srtf["short_ttft_mean_s"] < 0.25 * fcfs["short_ttft_mean_s"]      # shorts no longer wait for longs
    assert srtf["ttft_mean_s"] < 0.5 * fcfs["ttft_mean_s"]                    # optimal mean TTFT
    assert srtf["long_ttft_mean_s"] > fcfs["long_ttft_mean_s"]                # ... paid by the long prompts
    # two-level gets part of it: only the shorts staged together with the longs jump ahead
    assert srtf["ttft_mean_s"] < two["ttft_mean_s"] < fcfs["ttft_mean_s"]


def test_srtf_starves_a_long_prompt_and_two_level_does_not(rows):
    fcfs, srtf, two = (rows["starvation", p] for p in ("fcfs", "srtf", "two_level"))
    assert srtf["long_ttft_mean_s"] > 5 * two["long_ttft_mean_s"]            # waits for the whole stream
    assert two["long_ttft_mean_s"] < 1.5 * fcfs["long_ttft_mean_s"]
    assert srtf["short_ttft_mean_s"] < fcfs["short_ttft_mean_s"]


def test_priority_serves_high_priority_first(rows):
    fcfs, prio = rows["priority", "fcfs"], rows["priority", "priority"]
    assert prio["p0_ttft_mean_s"] < 0.75 * prio["p1_ttft_mean_s"]
    assert prio["p0_ttft_mean_s"] < 0.75 * fcfs["p0_ttft_mean_s"]
    assert fcfs["p0_ttft_mean_s"] == pytest.approx(fcfs["p1_ttft_mean_s"], rel=0.1)   # FCFS ignores priority
