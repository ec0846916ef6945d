"""``impala plot``: PNG figures of one or more runs from their ``metrics.jsonl``.

Panels: training and evaluation return against env steps and against wall time, the
learner's time breakdown (mean share of an update per ``time_*`` event), the estimated queue
sizes, the policy lag, throughput, and the panels that say why a run does not learn: each
critic's mean value with PopArt's statistics, the learning rate and entropy coefficient, policy
entropy, the losses, the gradient norms and V-trace's importance weights (every policy or
critic key of each event). Several runs are overlaid, one colour per run directory.
matplotlib is imported only when a figure is drawn, and only its Agg canvas is used, so no
display is ever needed and pyplot's global state is left alone.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from impala_rl.rundir import RunDirError

METRICS_FILE = "metrics.jsonl"
SINGLE_RUN_FILE = "plots.png"
MULTI_RUN_FILE = "impala_plots.png"

# The learner's time breakdown, in the order of an update, with short labels.
TIME_EVENTS = (
    ("time_collecting_actors", "collecting"),
    ("time_dequeuing_actors", "dequeuing"),
    ("time_learner_rollout", "rollout"),
    ("time_loss_computation", "loss"),
    ("time_backprob", "backprop"),
)

# Learning diagnostics: panel -> (statistic or ``event/`` prefix, line style). A prefix draws
# every key of a keyed event (``policy_entropy/0``, ``policy_entropy/left``, ...).
DIAGNOSTIC_PANELS = {
    "critic": (
        ("critic_value/", "-"),
        ("critic_popart_mu/", "--"),
        ("critic_popart_sigma/", ":"),
    ),
    "schedules": (("learning_rate", "-"), ("entropy_coef", "--")),
    "entropy": (("policy_entropy/", "-"),),
    "losses": (("policy_loss/", "-"), ("critic_value_loss/", "--"), ("total_loss", ":")),
    "gradient norms": (("grad_norm", "-"), ("policy_grad_norm/", "--"), ("critic_grad_norm/", ":")),
    "V-trace": (("vtrace_mean_rho/", "-"), ("vtrace_clipped_fraction/", "--")),
}
DIAGNOSTIC_TITLES = {
    "critic": ("critic (solid: mean value, dashed: PopArt mean, dotted: PopArt scale)", "return"),
    "schedules": ("schedules (solid: learning rate, dashed: entropy coefficient)", "value"),
    "entropy": ("policy entropy (nats)", "entropy"),
    "losses": ("losses before coefficients (solid: policy, dashed: value, dotted: total)", "loss"),
    "gradient norms": (
        "gradient norm before clipping (solid: all, dashed: policy, dotted: critic)",
        "norm",
    ),
    "V-trace": ("V-trace (solid: mean rho = pi/mu, dashed: clipped share)", "rho / share"),
}
# Panels whose lines may differ by orders of magnitude (a rate of 6e-4 beside a weight of
# 0.01): drawn on a log axis when every value is positive (an entropy weight of 0 is not).
DIAGNOSTIC_LOG_SCALE = frozenset({"schedules"})

Rows = list[dict[str, Any]]


def load_metrics(run_dir: str | Path) -> Rows:
    """The epoch rows of a run's ``metrics.jsonl``, one per epoch (the latest row wins).

    A resumed run may repeat epochs written after its last checkpoint; a half-written last
    line (a run still writing) is skipped.
    """
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    if not run_dir.is_dir():
        raise RunDirError(f"run directory {str(run_dir)!r} does not exist")
    if not path.is_file():
        raise RunDirError(
            f"{str(run_dir)!r} has no {METRICS_FILE} (not a run directory, "
            "or trained with log.jsonl=false)"
        )
    lines = path.read_text(encoding="utf-8").splitlines()
    by_epoch: dict[float, dict[str, Any]] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                continue
            raise RunDirError(f"{str(path)!r} line {number} is not valid JSON") from None
        if not isinstance(row, dict):
            raise RunDirError(f"{str(path)!r} line {number} is not a JSON object")
        epoch = _num(row.get("epoch"))
        by_epoch[number if math.isnan(epoch) else epoch] = row
    if not by_epoch:
        raise RunDirError(f"{str(path)!r} has no epochs yet")
    return [by_epoch[k] for k in sorted(by_epoch)]


def default_out(run_dirs: Sequence[str | Path]) -> Path:
    """``RUN_DIR/plots.png`` for one run, ``./impala_plots.png`` for several."""
    if len(run_dirs) == 1:
        return Path(run_dirs[0]) / SINGLE_RUN_FILE
    return Path(MULTI_RUN_FILE)


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path | None = None) -> Path:
    """Draw the runs' metrics into one PNG and return its path (see :func:`default_out`)."""
    if not run_dirs:
        raise ValueError("plot_runs needs at least one run directory")
    runs = {str(Path(d)): load_metrics(d) for d in run_dirs}
    out_path = Path(out) if out is not None else default_out(run_dirs)
    fig = make_figure(runs)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100, format="png")
    return out_path


def _series(rows: Rows, x_key: str, y_key: str) -> tuple[list[float], list[float]]:
    """Points of ``y_key`` against ``x_key``, skipping rows where either is missing or NaN."""
    xs, ys = [], []
    for row in rows:
        x, y = _num(row.get(x_key)), _num(row.get(y_key))
        if not (math.isnan(x) or math.isnan(y)):
            xs.append(x)
            ys.append(y)
    return xs, ys


def _num(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return math.nan
    return float(value)


def _mean(rows: Rows, key: str) -> float:
    values = [v for v in (_num(row.get(key)) for row in rows) if not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def matching_keys(rows: Rows, name: str) -> list[str]:
    """The statistics of ``rows`` that ``name`` names: itself, or every key under a prefix
    ending in ``/``; sorted."""
    if not name.endswith("/"):
        return [name] if any(name in row for row in rows) else []
    return sorted({key for row in rows for key in row if key.startswith(name)})


def _time_scale(runs: dict[str, Rows]) -> tuple[float, str]:
    longest = max((_num(r.get("wall_time_s")) for rows in runs.values() for r in rows), default=0)
    longest = 0.0 if math.isnan(longest) else longest
    if longest >= 3 * 3600:
        return 3600.0, "h"
    if longest >= 3 * 60:
        return 60.0, "min"
    return 1.0, "s"


def _no_data(ax: Any) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")


def make_figure(runs: dict[str, Rows]) -> Any:
    """A matplotlib ``Figure`` with the panels for ``{run label: epoch rows}``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    fig = Figure(figsize=(20, 13), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 4)
    ax_steps, ax_wall, ax_time, ax_sps = axes[0]
    ax_queue, ax_lag = axes[1][:2]
    diagnostic_axes = dict(zip(DIAGNOSTIC_PANELS, [*axes[1][2:], *axes[2]], strict=True))
    colors = [f"C{i % 10}" for i in range(len(runs))]
    scale, unit = _time_scale(runs)

    drawn = {ax: False for ax in axes.flat}
    for rows, color in zip(runs.values(), colors, strict=True):
        for ax, x_key, x_scale in (
            (ax_steps, "env_steps", 1.0),
            (ax_wall, "wall_time_s", scale),
        ):
            for y_key, style in (("episode_return/mean", "-"), ("eval_return/mean", "--")):
                xs, ys = _series(rows, x_key, y_key)
                if xs:
                    ax.plot([x / x_scale for x in xs], ys, style, color=color, marker=".")
                    drawn[ax] = True
        for y_key, style in (
            ("estimated_queue_sizes/before", "-"),
            ("estimated_queue_sizes/after", "--"),
        ):
            xs, ys = _series(rows, "env_steps", y_key)
            if xs:
                ax_queue.plot(xs, ys, style, color=color, marker=".")
                drawn[ax_queue] = True
        xs, ys = _series(rows, "env_steps", "policy_lag/mean")
        if xs:
            ax_lag.plot(xs, ys, "-", color=color, marker=".")
            drawn[ax_lag] = True
        lo_x, lo = _series(rows, "env_steps", "policy_lag/min")
        hi_x, hi = _series(rows, "env_steps", "policy_lag/max")
        if lo_x and lo_x == hi_x:
            ax_lag.fill_between(lo_x, lo, hi, color=color, alpha=0.2, linewidth=0)
            drawn[ax_lag] = True
        xs, ys = _series(rows, "env_steps", "steps_per_second")
        if xs:
            ax_sps.plot(xs, ys, "-", color=color, marker=".")
            drawn[ax_sps] = True
        for panel, ax in diagnostic_axes.items():
            for name, style in DIAGNOSTIC_PANELS[panel]:
                for key in matching_keys(rows, name):
                    xs, ys = _series(rows, "env_steps", key)
                    if xs:
                        ax.plot(xs, ys, style, color=color, marker=".", label=key)
                        drawn[ax] = True

    # time breakdown: grouped bars, one group per time_* event, one bar per run
    width = 0.8 / len(runs)
    for i, ((_, rows), color) in enumerate(zip(runs.items(), colors, strict=True)):
        shares = [_mean(rows, f"{event}/percent") for event, _ in TIME_EVENTS]
        if all(math.isnan(v) for v in shares):
            continue
        positions = [j - 0.4 + width * (i + 0.5) for j in range(len(TIME_EVENTS))]
        ax_time.bar(positions, [0.0 if math.isnan(v) else v for v in shares], width, color=color)
        drawn[ax_time] = True
    ax_time.set_xticks(range(len(TIME_EVENTS)), [label for _, label in TIME_EVENTS])

    titles = {
        ax_steps: ("return (solid: training, dashed: evaluation)", "env steps", "return"),
        ax_wall: ("return against wall time", f"wall time ({unit})", "return"),
        ax_time: ("learner time breakdown (mean per update)", "", "% of update time"),
        ax_queue: ("queue sizes (solid: before, dashed: after)", "env steps", "rollouts"),
        ax_lag: ("policy lag (line: mean, band: min-max)", "env steps", "updates"),
        ax_sps: ("throughput", "env steps", "env steps / s"),
        **{
            ax: (DIAGNOSTIC_TITLES[panel][0], "env steps", DIAGNOSTIC_TITLES[panel][1])
            for panel, ax in diagnostic_axes.items()
        },
    }
    for panel in DIAGNOSTIC_LOG_SCALE:
        ys = [y for line in diagnostic_axes[panel].lines for y in line.get_ydata()]
        if ys and min(ys) > 0:
            diagnostic_axes[panel].set_yscale("log")
    for ax, (title, xlabel, ylabel) in titles.items():
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if not drawn[ax]:
            _no_data(ax)
    handles = [Line2D([], [], color=c, linewidth=2) for c in colors]
    fig.legend(handles, list(runs), loc="outside lower center", ncols=min(len(runs), 3))
    return fig
