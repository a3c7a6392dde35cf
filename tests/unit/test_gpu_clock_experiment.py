"""scripts/gpu_clock_experiment.py's pure parts: nvidia-smi's clock-event
bitmask decoded (nvidia-smi --help-query-gpu lists the bits), samples
parsed and summarised over a window, the plan of each part, the estimate
that the budget uses."""

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import gpu_clock_experiment as experiment  # noqa: E402  isort:skip


def test_clock_event_reasons_are_decoded_bit_by_bit():
    assert experiment.decode_reasons(0x0) == []
    assert experiment.decode_reasons(0x4) == ["sw_power_cap"]
    assert experiment.decode_reasons(0x8 | 0x80) == ["hw_slowdown", "hw_power_brake_slowdown"]
    assert experiment.decode_reasons(0x20 | 0x40 | 0x1) == ["gpu_idle", "sw_thermal_slowdown", "hw_thermal_slowdown"]
    assert experiment.decode_reasons(0x4 | 0x1000) == ["sw_power_cap", "0x1000"]  # a bit nvidia-smi added later
    assert experiment.decode_reasons(None) == []


def test_samples_are_summarised_over_the_timed_window_only():
    """Samples at t = 0..9 s; the window [2, 5] holds t = 2, 3, 4, 5: their
    mean clock and power, and each watched reason's share (thermal counts
    either thermal bit). N/A values are left out, a line that is no sample
    is skipped."""
    masks = [0x1, 0x1, 0x4, 0x4 | 0x20, 0x4 | 0x40, 0x8 | 0x80, 0x1, 0x1, 0x1, 0x1]
    samples = [experiment.parse_sample(f"{1500 + 100 * t}, {500 + t}, {50 + t}, {hex(m)}", float(t))
               for t, m in enumerate(masks)]
    samples[3] = experiment.parse_sample("[N/A], 503, 53, 0x24", 3.0)
    assert experiment.parse_sample("clocks.sm [MHz], power.draw [W]", 0.0) is None
    summary = experiment.summarize(samples, [2.0, 5.0])
    assert summary["samples"] == 4
    assert summary["sm_mhz_mean"] == round((1700 + 1900 + 2000) / 3) and summary["sm_mhz_min"] == 1700
    assert summary["power_w_mean"] == round((502 + 503 + 504 + 505) / 4, 1) and summary["temp_c_max"] == 55
    assert (summary["share_sw_power_cap"], summary["share_thermal"]) == (0.75, 0.5)
    assert (summary["share_hw_slowdown"], summary["share_power_brake"]) == (0.25, 0.25)
    assert summary["reasons"] == ("sw_power_cap 3/4, sw_thermal_slowdown 1/4, hw_thermal_slowdown 1/4, "
                                  "hw_slowdown 1/4, hw_power_brake_slowdown 1/4")
    assert experiment.summarize(samples, [20.0, 30.0])["sm_mhz_mean"] == ""  # no sample inside


@pytest.mark.parametrize("gpu", [True, False])
def test_the_plan_of_each_part(gpu):
    """The configurations the experiment needs, in order: ours compiled with CUDA graphs
    on a GPU (not in ours-no-graphs), uncompiled without one; 30 updates,
    200 for the loss comparison at 350M."""
    configs = experiment.plan(["clocks", "loss", "fp8", "11b"], gpu)
    assert [(c.part, c.name, c.shape, c.updates) for c in configs] == [
        ("clocks", "anchor-old", "1p3b", 30), ("clocks", "anchor", "1p3b", 30), ("clocks", "ours", "1p3b", 30),
        ("clocks", "ours-no-graphs", "1p3b", 30), ("clocks", "ours-gpt2-init", "1p3b", 30),
        ("loss", "ours-loss-bf16", "350m", 200), ("loss", "ours-loss-fp8-tensorwise", "350m", 200),
        ("fp8", "anchor-bf16", "1p3b", 30), ("fp8", "ours-fp8-tensorwise", "1p3b", 30),
        ("fp8", "anchor-fp8-tensorwise", "1p3b", 30), ("fp8", "ours-fp8-rowwise", "1p3b", 30),
        ("fp8", "anchor-fp8-rowwise", "1p3b", 30),
        ("11b", "anchor", "11b_8layers", 30), ("11b", "ours", "11b_8layers", 30),
        ("11b", "ours-fp8-tensorwise", "11b_8layers", 30), ("11b", "anchor-fp8-tensorwise", "11b_8layers", 30)]
    by_name = {(c.part, c.name): c for c in configs}
    assert by_name["clocks", "anchor-old"].env == (("ANCHOR_INIT", "torch"), ("ANCHOR_DATA", "fixed"))
    assert by_name["fp8", "anchor-fp8-rowwise"].env == (("ANCHOR_FLOAT8", "rowwise"),)
    compiled = ("--compile-layers", "--cuda-graphs") if gpu else ()
    assert by_name["clocks", "ours"].flags == ("--precision", "bf16-autocast") + compiled
    assert by_name["clocks", "ours-no-graphs"].flags == ("--precision", "bf16-autocast") + compiled[:1]
    assert by_name["fp8", "ours-fp8-rowwise"].flags[-2:] == ("--fp8", "rowwise")
    tiny = experiment.plan(["loss"], gpu, shape="tiny", updates=8)
    assert {(c.shape, c.updates) for c in tiny} == {("tiny", 8)}
    assert [experiment.log_interval(n) for n in (4, 30, 40, 200)] == [1, 7, 10, 10]


def test_the_budget_estimate_is_the_longest_run_of_the_part_and_kind():
    config = experiment.plan(["fp8"], gpu=True)[1]  # ours-fp8-tensorwise
    assert experiment.estimate_s(config, [], tiny=False) == experiment.PRIOR_S["fp8"]
    finished = [{"part": "fp8", "kind": "ours", "wall_s": 50.0}, {"part": "fp8", "kind": "ours", "wall_s": 61.5},
                {"part": "fp8", "kind": "anchor", "wall_s": 90.0}, {"part": "clocks", "kind": "ours", "wall_s": 99.0}]
    assert experiment.estimate_s(config, finished, tiny=False) == 61.5
    assert experiment.device_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert experiment.device_slug("NVIDIA H200") == "h200"
