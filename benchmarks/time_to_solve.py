"""Wall-clock time to solve CartPole with the ``impala`` command, over several seeds.

Each seed runs ``python -m impala_rl.cli train cartpole seed=S log.console=false --run-dir D``
as its own process (plus ``runner.backend=...`` with ``--backend`` and any extra ``key=value``
overrides); the time is from starting the process to its exit, when ``summary.json`` has been
written. A run counts as solved when it stopped because the evaluation reached the preset's
``target_return`` (475).

    python benchmarks/time_to_solve.py
    python benchmarks/time_to_solve.py --backend subprocess --seeds 0 1 2 log.tensorboard=false
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_seed(seed: int, overrides: list[str], timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"impala-solve-{seed}-") as tmp:
        run_dir = Path(tmp) / "run"
        command = [
            sys.executable,
            "-m",
            "impala_rl.cli",
            "train",
            "cartpole",
            f"seed={seed}",
            "log.console=false",
            *overrides,
            "--run-dir",
            str(run_dir),
        ]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"seed": seed, "wall_s": time.perf_counter() - t0, "error": "timed out"}
        wall = time.perf_counter() - t0
        summary_path = run_dir / "summary.json"
        if not summary_path.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"seed": seed, "wall_s": wall, "error": f"exit {proc.returncode}: {tail}"}
        summary = json.loads(summary_path.read_text())
    return {"seed": seed, "wall_s": wall, **summary}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--backend", choices=("sequential", "subprocess"), default=None)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per seed")
    parser.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    args = parser.parse_args(argv)
    overrides = list(args.overrides)
    if args.backend:
        overrides.append(f"runner.backend={args.backend}")
    for item in overrides:
        if "=" not in item:
            parser.error(f"override {item!r} is not key=value")

    print(f"impala train cartpole {' '.join(overrides)}".rstrip())
    header = f"{'seed':>4}{'wall s':>9}{'env steps':>11}{'best eval':>11}  stopped because"
    print(header)
    print("-" * len(header))
    results = []
    for seed in args.seeds:
        r = run_seed(seed, overrides, args.timeout)
        results.append(r)
        if "error" in r and "stopped_because" not in r:
            print(f"{seed:>4}{r['wall_s']:>9.1f}  failed: {r['error']}")
            continue
        best = r["best_eval_return"]
        best_text = f"{best:.1f}" if best is not None else "-"
        print(
            f"{seed:>4}{r['wall_s']:>9.1f}{r['env_steps']:>11}{best_text:>11}  "
            f"{r['stopped_because']}"
        )
    print("-" * len(header))
    walls = [r["wall_s"] for r in results]
    solved = [r for r in results if r.get("stopped_because") == "target_return"]
    print(
        f"wall time: median {statistics.median(walls):.1f} s, "
        f"min {min(walls):.1f} s, max {max(walls):.1f} s (all seeds)"
    )
    if solved:
        sw = [r["wall_s"] for r in solved]
        steps = [r["env_steps"] for r in solved]
        print(
            f"solved runs: median {statistics.median(sw):.1f} s, min {min(sw):.1f} s, "
            f"max {max(sw):.1f} s; median {statistics.median(steps):,.0f} env steps"
        )
    print(f"solved {len(solved)}/{len(results)}")


if __name__ == "__main__":
    main()
