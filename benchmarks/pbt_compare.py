"""PBT against the same members trained apart: two ``impala tune --pbt`` populations of one run.

    impala tune env.id=LunarLander-v3 --pbt ... --study-dir runs/pbt-lunar
    impala tune env.id=LunarLander-v3 --pbt --no-exploit ... --study-dir runs/pbt-lunar-apart
    python benchmarks/pbt_compare.py runs/pbt-lunar runs/pbt-lunar-apart --threshold 200 \\
        --episodes 50 --out docs/img/pbt-lunarlander.png

Prints, per round, each population's best and mean score (the objective each member reported at
the round's end), the total env steps (all members) at which each population's best member
first reached ``--threshold``, and each member's final policy scored again over ``--episodes``
deterministic episodes on fresh envs (the same seeds for every member): the populations' means
and their ratio. Writes a figure of both populations' scores by env steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

MAX_EVAL_STEPS = 10_000


def load(study_dir: Path) -> dict[str, Any]:
    return json.loads((study_dir / "population.json").read_text())


def scores(state: dict[str, Any]) -> list[list[float]]:
    """Per round, each member's score."""
    return [[m["score"] for m in r["members"]] for r in state["rounds"]]


def steps_to(state: dict[str, Any], threshold: float) -> int | None:
    """Total env steps (every member's) when the best member first reached ``threshold``."""
    n = len(state["members"])
    for r in state["rounds"]:
        if max(m["score"] for m in r["members"]) >= threshold:
            return r["env_steps"] * n
    return None


def final_scores(study_dir: Path, n: int, episodes: int) -> list[float]:
    """Each member's last weights: mean return over ``episodes`` deterministic episodes."""
    from impala_rl import load_policy

    out = []
    for i in range(n):
        policy = load_policy(study_dir / "members" / str(i), which="last")
        env = policy.env_factory()
        returns = []
        for episode in range(episodes):
            obs, _ = env.reset(seed=10_000 + episode)
            policy.reset()
            total, done, steps = 0.0, False, 0
            while not done and steps < MAX_EVAL_STEPS:
                obs, reward, terminated, truncated, _ = env.step(
                    policy.act(obs, deterministic=True)
                )
                total += float(reward)
                done, steps = terminated or truncated, steps + 1
            returns.append(total)
        env.close()
        out.append(float(np.mean(returns)))
    return out


def plot(states: dict[str, dict[str, Any]], path: Path, threshold: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for k, (name, state) in enumerate(states.items()):
        steps = [r["env_steps"] for r in state["rounds"]]
        per_round = scores(state)
        for i in range(len(state["members"])):
            ax.plot(steps, [s[i] for s in per_round], color=f"C{k}", alpha=0.3, lw=1)
        ax.plot(steps, [statistics.mean(s) for s in per_round], color=f"C{k}", lw=2.5,
                marker="o", label=f"{name}: members (thin), mean (thick)")  # fmt: skip
    if threshold is not None:
        ax.axhline(threshold, color="gray", ls="--", lw=1)
    ax.set_xlabel("env steps per member")
    ax.set_ylabel("score at the round's end")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pbt", type=Path, help="the --pbt study directory")
    parser.add_argument("apart", type=Path, help="the --pbt --no-exploit study directory")
    parser.add_argument("--threshold", type=float)
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--out", type=Path, help="the figure (PNG)")
    args = parser.parse_args(argv)
    states = {"PBT": load(args.pbt), "apart": load(args.apart)}
    first = [m["values"] for m in states["PBT"]["rounds"][0]["members"]]
    if first != [m["values"] for m in states["apart"]["rounds"][0]["members"]]:
        raise SystemExit("the two populations did not start from the same members")
    print("| env steps per member | PBT best | PBT mean | apart best | apart mean |")
    print("| --- | --- | --- | --- | --- |")
    for a, b in zip(states["PBT"]["rounds"], states["apart"]["rounds"], strict=False):
        sa, sb = [m["score"] for m in a["members"]], [m["score"] for m in b["members"]]
        print(
            f"| {a['env_steps']:,} | {max(sa):.1f} | {statistics.mean(sa):.1f} "
            f"| {max(sb):.1f} | {statistics.mean(sb):.1f} |"
        )
    if args.threshold is not None:
        for name, state in states.items():
            reached = steps_to(state, args.threshold)
            shown = "not reached" if reached is None else f"{reached:,} total env steps"
            print(f"{name}: best member >= {args.threshold:g} at {shown}")
    means = {}
    for name, path in (("PBT", args.pbt), ("apart", args.apart)):
        finals = final_scores(path, len(states[name]["members"]), args.episodes)
        means[name] = statistics.mean(finals)
        print(f"{name}: final weights over {args.episodes} episodes: "
              f"{', '.join(f'{s:.1f}' for s in finals)}; mean {means[name]:.1f}")  # fmt: skip
    print(f"PBT mean / apart mean: {means['PBT'] / means['apart']:.2f}")
    if args.out:
        plot(states, args.out, args.threshold)
        print(f"figure: {args.out}")


if __name__ == "__main__":
    main()
