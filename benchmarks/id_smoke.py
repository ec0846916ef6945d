"""Every kind of id a user may type, run once: ``impala train env.id=ID max_env_steps=N``.

A first run on a user's own env fails on the id, the env's API or its spaces long before it
fails on learning. This runs a short training (``--steps``, 1,024 env steps by default) of one
id per family that is installed here, each as its own process, and records whether it ran to
its budget, the error line it ended with otherwise, and the seconds it took:

- Gymnasium's own ids (classic control, Box2D, toy text, MuJoCo v5, the functional ``phys2d``
  and ``tabular`` ids, which need jax);
- MiniGrid and BabyAI, one id per level family; MinAtar; ALE ``ALE/...-v5`` ids and the legacy
  ones older code types (``PongNoFrameskip-v4``, ``Breakout-v0``);
- the ids of packages registered on import (highway-env, flappy-bird-gymnasium...), typed bare;
- PettingZoo games typed as their module (``pettingzoo.classic.connect_four_v3``).

A run that ends with a one-line ``impala: error:`` (a package to install, say) is an expected
refusal; a traceback or a timeout is a bug to look at. Records land in ``OUT/results.json``
as they finish, and a killed sweep started again skips what is done.

    python benchmarks/id_smoke.py --out runs/id-smoke
    python benchmarks/id_smoke.py --out runs/id-smoke --only MiniGrid- pettingzoo.
    python benchmarks/id_smoke.py --list       # the ids it would run
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

LEGACY_ATARI = ["PongNoFrameskip-v4", "BreakoutNoFrameskip-v4", "SpaceInvaders-v4", "Breakout-v0"]
MODERN_ATARI = ["ALE/Pong-v5", "ALE/Breakout-v5", "ALE/MontezumaRevenge-v5"]
MINATAR = ["MinAtar/Breakout-v1", "MinAtar/Seaquest-v1", "MinAtar/Asterix-v1"]
PROVIDED = {  # package -> ids typed bare, as its docs type them after an import
    "highway_env": ["highway-fast-v0", "merge-v0", "parking-v0", "intersection-v0"],
    "flappy_bird_gymnasium": ["FlappyBird-v0"],
}
PETTINGZOO = [
    "pettingzoo.classic.tictactoe_v3",
    "pettingzoo.classic.connect_four_v3",
    "pettingzoo.classic.rps_v2",
    "pettingzoo.classic.leduc_holdem_v4",
    "pettingzoo.classic.texas_holdem_no_limit_v6",
    "pettingzoo.classic.chess_v6",
    "pettingzoo.butterfly.knights_archers_zombies_v11",
    "pettingzoo.sisl.multiwalker_v9",
    "pettingzoo.sisl.pursuit_v5",
]
MUJOCO = {
    "Reacher",
    "Pusher",
    "InvertedPendulum",
    "InvertedDoublePendulum",
    "HalfCheetah",
    "Hopper",
    "Swimmer",
    "Walker2d",
    "Ant",
    "Humanoid",
    "HumanoidStandup",
}
LEVEL_SUFFIX = re.compile(r"[-_]?(\d+x\d+|S\d+|N\d+|R\d+|Random|v\d+)")


def gymnasium_ids() -> list[str]:
    """Gymnasium's own ids: the newest version of each, MuJoCo's v5."""
    import gymnasium as gym

    newest: dict[str, tuple[int, str]] = {}
    for env_id, spec in gym.registry.items():
        if not str(spec.entry_point).startswith("gymnasium."):
            continue
        name = env_id.rsplit("-v", 1)[0]
        if name.split("/")[-1] in MUJOCO and not env_id.endswith("-v5"):
            continue
        version = spec.version or 0
        if name not in newest or version > newest[name][0]:
            newest[name] = (version, env_id)
    return [env_id for _, env_id in newest.values()]


def grid_ids() -> list[str]:
    """One MiniGrid or BabyAI id per level family (sizes and counts stripped)."""
    if importlib.util.find_spec("minigrid") is None:
        return []
    import gymnasium as gym
    import minigrid  # noqa: F401 (registers the ids)

    seen: dict[str, str] = {}
    for env_id in gym.registry:
        if env_id.startswith(("MiniGrid-", "BabyAI-")):
            seen.setdefault(LEVEL_SUFFIX.sub("", env_id), env_id)
    return list(seen.values())


def all_ids() -> list[str]:
    ids = gymnasium_ids() + grid_ids()
    if importlib.util.find_spec("minatar") is not None:
        ids += MINATAR
    if importlib.util.find_spec("ale_py") is not None:
        ids += MODERN_ATARI + LEGACY_ATARI
    for package, provided in PROVIDED.items():
        if importlib.util.find_spec(package) is not None:
            ids += provided
    if importlib.util.find_spec("pettingzoo") is not None:
        ids += PETTINGZOO
    return ids


def run_one(env_id: str, steps: int, timeout: float, run_dir: Path) -> dict:
    """One training process; its outcome: ran | refused (one error line) | failed | timeout."""
    command = [
        sys.executable,
        "-m",
        "impala_rl.cli",
        "train",
        f"env.id={env_id}",
        f"max_env_steps={steps}",
        "log.console=false",
        "--run-dir",
        str(run_dir),
    ]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"outcome": "timeout", "seconds": round(time.perf_counter() - start, 1)}
    seconds = round(time.perf_counter() - start, 1)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    if done.returncode == 0:
        return {"outcome": "ran", "seconds": seconds}
    if last.startswith("impala: error:") and "Traceback" not in done.stderr:
        return {"outcome": "refused", "seconds": seconds, "error": last}
    return {"outcome": "failed", "seconds": seconds, "error": last}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/id-smoke"))
    parser.add_argument("--steps", type=int, default=1024)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per id")
    parser.add_argument("--only", nargs="+", default=[], help="id prefixes to run")
    parser.add_argument("--list", action="store_true", help="print the ids and exit")
    args = parser.parse_args()
    ids = [i for i in all_ids() if not args.only or i.startswith(tuple(args.only))]
    if args.list:
        print("\n".join(ids))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    record = args.out / "results.json"
    results = json.loads(record.read_text()) if record.exists() else {}
    for env_id in ids:
        if env_id in results:
            continue
        run_dir = args.out / "runs" / re.sub(r"[^A-Za-z0-9_.-]", "_", env_id)
        results[env_id] = run_one(env_id, args.steps, args.timeout, run_dir)
        record.write_text(json.dumps(results, indent=1))
        r = results[env_id]
        print(f"{env_id:50s} {r['outcome']:8s} {r['seconds']:7.1f} s  {r.get('error', '')}")
    counts = {
        o: sum(r["outcome"] == o for r in results.values())
        for o in ("ran", "refused", "failed", "timeout")
    }
    print(", ".join(f"{n} {o}" for o, n in counts.items()), f"of {len(results)} ids")


if __name__ == "__main__":
    main()
