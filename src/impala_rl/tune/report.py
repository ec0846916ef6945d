"""What a study or a population leaves: a table of trials best first, the best settings as a
config file, and figures (objective per trial and per parameter; a population's scores, values
and exploits by round)."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from impala_rl.config import to_yaml
from impala_rl.tune.runs import finite
from impala_rl.tune.space import Param, overrides_of


def trial_state(trial: Any) -> str:
    """Optuna's state of ``trial`` in lower case, ``stopped`` for one that the tuner's stop
    ended (Optuna's ``fail``: it runs again, resumed, when the study continues)."""
    state = trial.state.name.lower()
    return "stopped" if state == "fail" and trial.user_attrs.get("stopped") else state


def trial_rows(study: Any, space: list[Param], maximize: bool = True) -> list[dict[str, Any]]:
    """One row per trial, best first (trials without a value last): number, state, value,
    each parameter's value, the run directory, and why a failed trial failed."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        row: dict[str, Any] = {"trial": t.number, "state": trial_state(t), "value": t.value}
        # a trial queued to run again (stopped before) has its values and run directory fixed
        params = t.params or t.system_attrs.get("fixed_params", {})
        for p in space:
            raw = params.get(p.key)
            row[p.key] = p.choices[raw] if p.kind == "choice" and raw is not None else raw
        row["run_dir"] = t.user_attrs.get("run_dir") or t.user_attrs.get("resume_from", "")
        row["error"] = t.user_attrs.get("error", "")
        rows.append(row)

    def rank(row: dict[str, Any]) -> float:
        value = row["value"]
        if not finite(value):
            return math.inf
        return -value if maximize else value

    return sorted(rows, key=rank)


def write_trials_csv(rows: list[dict[str, Any]], path: Path) -> None:
    if not rows:
        return
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def rich_table(rows: list[dict[str, Any]], title: str, limit: int = 20) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    if not rows:
        return table
    names = [name for name in rows[0] if name != "error"]  # the console line says it
    for name in names:
        table.add_column(name, justify="right" if name != "state" else "left")
    for row in rows[:limit]:
        table.add_row(*(_cell(row[name]) for name in names))
    return table


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def best_values(study: Any, space: list[Param]) -> dict[str, Any] | None:
    """The best trial's value of each parameter (``None`` before a trial completed)."""
    try:
        best = study.best_trial
    except ValueError:
        return None
    return {
        p.key: p.choices[best.params[p.key]] if p.kind == "choice" else best.params[p.key]
        for p in space
    }


def write_best_config(
    preset: str | None,
    overrides: list[str],
    values: dict[str, Any],
    objective: str,
    score: float,
    path: Path,
) -> None:
    """The study's config with the best values (for an ``env.id`` without a preset, the
    defaults ``impala train`` chose for it), as a file ``impala train --config`` runs."""
    from impala_rl.env_defaults import resolve_config

    cfg = resolve_config(preset, [*overrides, *overrides_of(values)])
    cfg.log.run_dir, cfg.runner.sized_for = None, None
    header = [f"# impala tune: the best settings found ({objective} {score:.6g})"]
    header += [f"#   {item}" for item in overrides_of(values)]
    header.append("# run: impala train --config best.yaml")
    path.write_text("\n".join(header) + "\n" + to_yaml(cfg))


def plot_study(study: Any, space: list[Param], objective: str, path: Path) -> None:
    """The objective per trial (the best so far as a line) and against each parameter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trials = [t for t in study.get_trials(deepcopy=False) if finite(t.value)]
    n = 1 + len(space)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.4 * rows), squeeze=False)
    ax = axes[0][0]
    numbers = [t.number for t in trials]
    values = [t.value for t in trials]
    ax.scatter(numbers, values, s=14)
    best, line = -math.inf, []
    for v in values:
        best = max(best, v)
        line.append(best)
    ax.step(numbers, line, where="post", color="C1", label="best so far")
    ax.set_xlabel("trial")
    ax.set_ylabel(objective)
    ax.legend(loc="lower right", fontsize=8)
    for k, p in enumerate(space, start=1):
        ax = axes[k // cols][k % cols]
        xs = [t.params[p.key] for t in trials if p.key in t.params]
        ys = [t.value for t in trials if p.key in t.params]
        if p.kind == "choice":
            ax.set_xticks(range(len(p.choices)), [str(c) for c in p.choices])
        ax.scatter(xs, ys, s=14)
        if p.log:
            ax.set_xscale("log")
        ax.set_xlabel(p.key)
        ax.set_ylabel(objective)
    for k in range(n, rows * cols):
        axes[k // cols][k % cols].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_population(state: dict[str, Any], space: list[Param], objective: str, path: Path) -> None:
    """Each member's score by round (an exploit drawn from its parent) and its values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = state["rounds"]
    n = len(state["members"])
    fig, axes = plt.subplots(1 + len(space), 1, figsize=(7, 2.6 * (1 + len(space))), squeeze=False)
    ax = axes[0][0]
    steps = [r["env_steps"] for r in rounds]
    for i in range(n):
        ax.plot(
            steps,
            [r["members"][i]["score"] for r in rounds],
            marker="o",
            ms=3,
            color=f"C{i}",
            label=f"member {i}",
        )
    for a, b in zip(rounds[:-1], rounds[1:], strict=False):
        for i, m in enumerate(b["members"]):
            if m["parent"] is not None:
                parent = a["members"][m["parent"]]
                ax.annotate(
                    "",
                    xy=(b["env_steps"], m["score"]),
                    xytext=(a["env_steps"], parent["score"]),
                    arrowprops={"arrowstyle": "->", "color": f"C{i}", "alpha": 0.6, "ls": "--"},
                )
    ax.set_ylabel(objective)
    ax.legend(fontsize=7, ncol=min(n, 4))
    for k, p in enumerate(space, start=1):
        ax = axes[k][0]
        for i in range(n):
            ax.plot(
                steps, [r["members"][i]["values"][p.key] for r in rounds], marker=".", color=f"C{i}"
            )
        if p.log:
            ax.set_yscale("log")
        ax.set_ylabel(p.key, fontsize=8)
    axes[-1][0].set_xlabel("env steps")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def population_rows(state: dict[str, Any], space: list[Param]) -> list[dict[str, Any]]:
    """The last round's members, best first."""
    if not state["rounds"]:
        return []
    last = state["rounds"][-1]
    rows = []
    for i, m in enumerate(last["members"]):
        row: dict[str, Any] = {"member": i, "score": m["score"], "parent": m["parent"]}
        row.update({p.key: m["values"][p.key] for p in space})
        rows.append(row)
    return sorted(rows, key=lambda r: -r["score"] if finite(r["score"]) else math.inf)
