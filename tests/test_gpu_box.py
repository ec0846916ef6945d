"""benchmarks/gpu_box.py's pure parts: its arguments and the servers' figures it reads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
try:
    import gpu_box
finally:
    sys.path.pop(0)


def test_variants_come_after_the_preset_and_its_overrides():
    args = gpu_box.parse_args(
        [
            "--vs",
            "runner.inference_servers=2",
            "--vs",
            "a=1 b=2",
            "pong",
            "runner.inference=central",
        ]
    )
    assert args.preset == "pong"
    assert args.overrides == ["runner.inference=central"]
    assert args.vs == ["runner.inference_servers=2", "a=1 b=2"]
    assert gpu_box.parse_args([]).overrides == gpu_box.DEFAULT_OVERRIDES
    assert gpu_box.parse_args([]).vs == []


def test_several_servers_figures_are_summed_weighted_by_their_batches():
    log = (
        "INFO inference server 1 of 2: 300 batches of 2.0 requests, 1.00 ms each; busy 60% of\n"
        "    the time, loading weights 4%\n"
        "INFO inference server 2 of 2: 100 batches of 4.0 requests, 3.00 ms each; busy 80% of "
        "the time, loading weights 6%\n"
    )
    figures = gpu_box.server_figures(log)
    assert figures is not None
    assert figures["servers"] == 2 and figures["batches"] == 400
    assert figures["requests_per_batch"] == pytest.approx((300 * 2 + 100 * 4) / 400)
    assert figures["ms_per_batch"] == pytest.approx((300 * 1 + 100 * 3) / 400)
    assert figures["busy_percent"] == 70 and figures["loading_weights_percent"] == 5
    assert gpu_box.server_figures("no server here") is None
