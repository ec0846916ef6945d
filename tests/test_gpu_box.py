"""benchmarks/gpu_box.py's pure parts (its arguments, the servers' figures it reads) and the
overrides scripts/gpu_session.sh sends to the device."""

from __future__ import annotations

import re
import shlex
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


def _session_overrides() -> list[list[str]]:
    """Every set of overrides ``scripts/gpu_session.sh`` trains ``pong_appo`` with on the
    device: its ``--vs`` strings (``$sized`` expanded) and its ``train NAME SEED ...`` lines."""
    text = (Path(__file__).parents[1] / "scripts" / "gpu_session.sh").read_text()
    sized = re.search(r"^\s*sized='([^']*)'", text, re.M)
    found = []
    for quoted in re.findall(r"--vs ('[^']*'|\"[^\"]*\")", text):
        words = quoted[1:-1].replace("$sized", sized.group(1) if sized else "")
        found.append(words.split())
    for line in re.findall(r"^\s*train pong_appo-\S+ \d+ ([^#\n]*)", text, re.M):
        found.append(shlex.split(line))
    return found


def test_the_device_scripts_overrides_pass_the_config_on_a_sized_gpu_box(monkeypatch):
    """Device time is scarce: a lever the config refuses (an override that needs another the
    sizing would give, say) must fail here, not on the GPU box. Each is resolved as
    ``impala train pong_appo`` resolves it, sized to a 16-core H200 box."""
    from impala_rl import sizing
    from impala_rl.env_defaults import resolve_config

    overrides = _session_overrides()
    assert len(overrides) >= 6  # the THROUGHPUT levers, LEVERS' runs, the DRY variant
    monkeypatch.setattr(sizing, "detect_machine", lambda: sizing.Machine(16, "NVIDIA H200"))
    for extra in overrides:
        assert all("=" in word for word in extra), extra
        cfg = resolve_config("pong_appo", extra)
        assert cfg.algorithm.device == "cuda"
