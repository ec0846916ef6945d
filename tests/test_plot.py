"""``impala plot``: PNGs from runs' metrics.jsonl, overlays, defaults and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import impala_rl
from impala_rl import cli
from impala_rl.plot import load_metrics, make_figure, plot_runs
from impala_rl.rundir import RunDirError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FAST = [
    "algorithm.n_epochs=2",
    "algorithm.epoch_length=2",
    "algorithm.rollout_evaluator.n_episodes=2",
    "log.console=false",
    "log.tensorboard=false",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[Path]:
    """Two short real runs with different seeds."""
    root = tmp_path_factory.mktemp("plot")
    dirs = [root / "seed0", root / "seed1"]
    for seed, run_dir in enumerate(dirs):
        impala_rl.train("cartpole", [*FAST, f"seed={seed}"], run_dir=run_dir)
    return dirs


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 10_000


def test_plot_one_run_via_the_cli(runs, tmp_path, capsys):
    out = tmp_path / "sub" / "one.png"
    assert cli.main(["plot", str(runs[0]), "--out", str(out)]) == 0
    assert_png(out)
    assert capsys.readouterr().out.strip() == str(out)


def test_plot_two_runs_overlaid(runs, tmp_path):
    out = tmp_path / "both.png"
    assert cli.main(["plot", *map(str, runs), "--out", str(out)]) == 0
    assert_png(out)
    fig = make_figure({str(d): load_metrics(d) for d in runs})
    legend_texts = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert legend_texts == [str(d) for d in runs]
    # both runs are drawn in the return panels
    ax_steps, ax_wall = fig.axes[0], fig.axes[1]
    assert len(ax_steps.lines) == len(ax_wall.lines) == 2 * len(runs)


def test_default_outputs(runs, tmp_path, monkeypatch):
    assert plot_runs([runs[0]]) == runs[0] / "plots.png"
    assert_png(runs[0] / "plots.png")
    monkeypatch.chdir(tmp_path)
    assert plot_runs(runs) == Path("impala_plots.png")
    assert_png(tmp_path / "impala_plots.png")


def test_missing_metrics_is_a_one_line_error(runs, tmp_path, capsys):
    empty = tmp_path / "not_a_run"
    empty.mkdir()
    code = cli.main(["plot", str(runs[0]), str(empty), "--out", str(tmp_path / "x.png")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1
    assert err.startswith("impala: error:")
    assert str(empty) in err and "metrics.jsonl" in err
    assert not (tmp_path / "x.png").exists()
    assert cli.main(["plot", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_sparse_and_resumed_metrics_are_tolerated(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [
        {"epoch": 1, "env_steps": 100, "wall_time_s": 1.0, "episode_return/mean": 10.0},
        {"epoch": 2, "env_steps": 200, "wall_time_s": 2.0, "episode_return/mean": None},
        # a resume repeats epoch 2; the later row wins
        {"epoch": 2, "env_steps": 200, "wall_time_s": 2.5, "episode_return/mean": 12.0},
        {"epoch": 3, "env_steps": 300, "wall_time_s": 3.0, "eval_return/mean": 20.0},
    ]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"epoch": 4, "env_'  # half-written
    (run_dir / "metrics.jsonl").write_text(text)
    loaded = load_metrics(run_dir)
    assert [r["epoch"] for r in loaded] == [1, 2, 3]
    assert loaded[1]["wall_time_s"] == 2.5
    assert_png(plot_runs([run_dir]))
    (run_dir / "metrics.jsonl").write_text("")
    with pytest.raises(RunDirError, match="no epochs"):
        load_metrics(run_dir)


def test_import_impala_rl_does_not_import_matplotlib():
    code = (
        "import sys, impala_rl, impala_rl.cli, impala_rl.plot; "
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_learning_diagnostics_are_drawn_for_every_key(runs, tmp_path):
    from impala_rl.plot import DIAGNOSTIC_PANELS

    fig = make_figure({str(runs[0]): load_metrics(runs[0])})
    by_title = {ax.get_title().split(" (")[0]: ax for ax in fig.axes if ax.get_visible()}
    labels = {t: {line.get_label() for line in ax.lines} for t, ax in by_title.items()}
    # a real run records every statistic these panels read
    assert labels["policy entropy"] == {"policy_entropy/0"}
    assert labels["losses before coefficients"] == {
        "policy_loss/0",
        "critic_value_loss/0",
        "total_loss",
    }
    assert labels["gradient norm before clipping"] == {
        "grad_norm",
        "policy_grad_norm/0",
        "critic_grad_norm/0",
    }
    assert labels["V-trace"] == {"vtrace_mean_rho/0", "vtrace_clipped_fraction/0"}
    assert labels["critic"] == {"critic_value/0"}  # no PopArt in this run
    assert labels["schedules"] == {"learning_rate", "entropy_coef"}
    assert by_title["schedules"].get_yscale() == "log"
    assert len(DIAGNOSTIC_PANELS) == 6
    # a structured run's keys each get a line; a run without them says "no data"
    run_dir = tmp_path / "keyed"
    run_dir.mkdir()
    rows = [
        {
            "epoch": e,
            "env_steps": 100 * e,
            "policy_entropy/left": 1.0,
            "policy_entropy/right": 0.9,
            "critic_popart_mu/0": 0.5 * e,
            "critic_popart_sigma/0": 1.0 + e,
        }
        for e in (1, 2)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig = make_figure({"keyed": load_metrics(run_dir)})
    by_title = {ax.get_title().split(" (")[0]: ax for ax in fig.axes if ax.get_visible()}
    entropy = by_title["policy entropy"]
    assert sorted(line.get_label() for line in entropy.lines) == [
        "policy_entropy/left",
        "policy_entropy/right",
    ]
    assert sorted(line.get_label() for line in by_title["critic"].lines) == [
        "critic_popart_mu/0",
        "critic_popart_sigma/0",
    ]
    assert [t.get_text() for t in by_title["V-trace"].texts] == ["no data"]
    assert by_title["schedules"].get_yscale() == "linear"  # nothing drawn: no log axis
    # an entropy weight of 0 keeps the schedules on a linear axis, where it can be seen
    rows = [{"epoch": 1, "env_steps": 100, "learning_rate": 3e-4, "entropy_coef": 0.0}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig = make_figure({"keyed": load_metrics(run_dir)})
    by_title = {ax.get_title().split(" (")[0]: ax for ax in fig.axes if ax.get_visible()}
    assert by_title["schedules"].get_yscale() == "linear"
