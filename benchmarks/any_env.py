"""A user's first run on their own env: ``impala train env.id=ID`` against SB3's PPO defaults.

For each env, seed and library, one training run as its own process on the same env-step
budget, timed from the process's start to its exit:

- **impala-rl**: ``python -m impala_rl.cli train env.id=ID seed=S max_env_steps=N`` with no
  other setting (``--impala-args`` adds some, for experiments);
- **SB3**: ``PPO(policy, env, seed=S).learn(N)`` with SB3's defaults, the policy its docs name
  for the observation (``MlpPolicy``, ``CnnPolicy`` for images, ``MultiInputPolicy`` for a
  Dict), on the env with the wrapper its users put there where SB3 needs one to run at all
  (MiniGrid: ``FlatObsWrapper``, RL-Zoo's; a Tuple such as Blackjack's: Gymnasium's
  ``FlattenObservation``).

Then the final policy of each run plays its env's number of deterministic episodes (20;
FrozenLake 1,000, where one of 20 would be 0.05; Blackjack 10,000 hands, whose exact returns
``blackjack_exact.py`` gives; ``--episodes`` for all) on fresh envs with
the same seeds for both (its score: the mean return). The table gives, per env, the
median over seeds of the score and of the wall time of each library and the ratios
(impala-rl / SB3). Everything lands in ``OUT/results.json`` as it finishes (commands started
side by side into one OUT keep each other's records): a killed run is started again with the
same command and skips what is done. Runs alternate between the libraries (seed by seed), so a
change in the machine's load falls on both.

    pip install -e '.[bench]'    # SB3, highway-env, flappy-bird-gymnasium (benchmark only)
    python benchmarks/any_env.py --out runs/any-env               # every env, seeds 0 1 2
    python benchmarks/any_env.py --envs gridworld catch --seeds 0 --out runs/any-env-try
    python benchmarks/any_env.py --table runs/any-env             # the table of what is done
    python benchmarks/any_env.py --envs taxi --episodes 100 --out runs/taxi  # 100 episodes each
    python benchmarks/any_env.py --carry benchmarks/results/any_env.json --out runs/any-env

The records that made docs/results.md's table are kept in ``benchmarks/results/any_env.json``;
``--carry`` starts from them, so a later session runs only what is missing (a seed's two runs
always come from one session: the time ratio is taken per seed; a record scored over another
number of episodes is run again).

One run at a time: SB3 takes torch's threads (one per core), and two SB3 runs on two cores
each with two threads crawl (Unlock: unfinished after 19 minutes, ~2 minutes alone). To screen
scores two at a time, give SB3 one thread each (``OMP_NUM_THREADS=1``); its wall times then
do not compare.

Envs marked ``tuned`` are those the no-preset defaults were chosen on; the others are held out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
MAX_EVAL_STEPS = 10_000  # an evaluation episode's cap, for envs a good policy never ends


@dataclass(frozen=True)
class Env:
    """One benchmark env: our ``env.id``, its budget, how SB3 runs it."""

    env_id: str
    steps: int
    sb3_policy: str = "MlpPolicy"
    sb3_wrapper: str | None = None  # "minigrid_flat", "flatten" (a Tuple SB3 refuses)
    tuned: bool = False
    kind: str = ""
    episodes: int = 20
    kwargs: dict[str, Any] = field(default_factory=dict)


ENVS: dict[str, Env] = {
    "gridworld": Env(
        "impala_rl.envs.samples:GridWorld",
        100_000,
        "MultiInputPolicy",
        tuned=True,
        kind="grid world, Dict of int coordinates",
    ),
    "catch": Env(
        "impala_rl.envs.samples:Catch",
        50_000,
        "CnnPolicy",
        tuned=True,
        kind="pixel game, channels-last RGB",
    ),
    "pointgoal": Env(
        "impala_rl.envs.samples:PointGoal",
        100_000,
        "MultiInputPolicy",
        tuned=True,
        kind="continuous control, Dict of vectors",
    ),
    "minigrid-unlock": Env(
        "MiniGrid-Unlock-v0", 100_000, sb3_wrapper="minigrid_flat", kind="MiniGrid room"
    ),
    "minigrid-lavagap": Env(
        "MiniGrid-LavaGapS5-v0", 100_000, sb3_wrapper="minigrid_flat", kind="MiniGrid room"
    ),
    "minigrid-doorkey": Env(  # the minigrid preset's own env
        "MiniGrid-DoorKey-5x5-v0",
        100_000,
        sb3_wrapper="minigrid_flat",
        tuned=True,
        kind="MiniGrid room",
    ),
    "babyai-gotoredballgrey": Env(
        "BabyAI-GoToRedBallGrey-v0",
        200_000,
        sb3_wrapper="minigrid_flat",
        kind="BabyAI level (a mission in words)",
    ),
    "minatar-freeway": Env(  # minatar_short's settings were picked on its seed 0
        "MinAtar/Freeway-v1", 300_000, tuned=True, kind="MinAtar game"
    ),
    "inverted-double-pendulum": Env("InvertedDoublePendulum-v5", 200_000, kind="MuJoCo"),
    "taxi": Env("Taxi-v4", 100_000, kind="toy text, Discrete observation"),
    "frozenlake": Env(  # one episode of 20 would be 0.05: the optimum, 0.744, reads 0.65-0.75
        "FrozenLake-v1", 100_000, kind="toy text, slippery ice (Discrete)", episodes=1000
    ),
    "cliffwalking": Env("CliffWalking-v1", 100_000, kind="toy text, a cliff (Discrete)"),
    "blackjack": Env(  # a hand's return is -1, 0 or 1 (1.5 never: natural=False): many hands
        "Blackjack-v1",
        100_000,
        sb3_wrapper="flatten",
        kind="toy text, a Tuple of Discretes",
        episodes=10_000,
    ),
    "breakout-ram": Env(  # SB3: gym.make("ALE/Breakout-v5", obs_type="ram"), as its users write it
        "ALE/Breakout-ram-v5", 500_000, kind="an ALE game's RAM (128 bytes)", episodes=10
    ),
    "flappy-bird": Env(
        "flappy_bird_gymnasium:FlappyBird-v0", 200_000, kind="third-party package (lidar)"
    ),
    "highway": Env(
        "highway_env:highway-fast-v0", 20_000, kind="third-party package, slow steps", episodes=10
    ),
}
DEFAULT_EPISODES = {name: spec.episodes for name, spec in ENVS.items()}  # before --episodes


EPISODES_BEFORE_THE_KEY = {"frozenlake": 20}
"""A record without ``episodes`` was scored over its env's default then: today's, but these."""


def scored_as_now(record: dict[str, Any]) -> bool:
    """Whether a record was scored over the episodes its env is scored over now."""
    spec = ENVS.get(record["env"])
    if spec is None:
        return False
    then = EPISODES_BEFORE_THE_KEY.get(record["env"], DEFAULT_EPISODES[record["env"]])
    return record.get("episodes", then) == spec.episodes


# -- one training run per process ------------------------------------------------------------
def make_env(spec: Env, for_sb3: bool) -> Any:
    """The env as a user makes it (SB3: with the wrapper SB3 needs)."""
    import gymnasium as gym

    if spec.env_id.startswith("impala_rl.envs.samples:"):
        from impala_rl.envs import samples

        env = getattr(samples, spec.env_id.split(":")[1])(**spec.kwargs)
    else:
        env_id = spec.env_id
        if ":" in env_id:  # package:EnvId, Gymnasium's form
            module, _, env_id = env_id.partition(":")
            __import__(module)
        if env_id.startswith(("MiniGrid-", "BabyAI-")):
            import minigrid  # noqa: F401  (registers its ids)
        if env_id.startswith("MinAtar/"):  # its own Gymnasium env: bool [10, 10, C] frames
            import minatar.gym

            if env_id not in gym.registry:
                minatar.gym.register_envs()
        if env_id.startswith("ALE/"):
            import ale_py

            from impala_rl.envs.atari import split_ram_id

            gym.register_envs(ale_py)
            env_id, ram = split_ram_id(env_id)  # gym's RAM ids, which ale-py no longer registers
            if ram:
                spec = dataclasses.replace(spec, kwargs={"obs_type": "ram", **spec.kwargs})
        env = gym.make(env_id, **spec.kwargs)
    if for_sb3 and spec.sb3_wrapper == "minigrid_flat":
        from minigrid.wrappers import FlatObsWrapper

        env = FlatObsWrapper(env)
    if for_sb3 and spec.sb3_wrapper == "flatten":  # SB3 refuses a Tuple observation
        env = gym.wrappers.FlattenObservation(env)
    return env


def sb3_train(name: str, seed: int, out: Path) -> None:
    """One SB3 run (in its own process): PPO with its defaults, saved to ``out``."""
    from stable_baselines3 import PPO

    spec = ENVS[name]
    model = PPO(spec.sb3_policy, make_env(spec, for_sb3=True), seed=seed, verbose=0)
    model.learn(spec.steps)
    model.save(out / "model.zip")


def run_one(name: str, lib: str, seed: int, out: Path, impala_args: list[str]) -> dict:
    """Train ``lib`` on env ``name`` with ``seed`` as its own process, timed; its record."""
    spec = ENVS[name]
    run_dir = out / name / f"{lib}-seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    if lib == "impala":
        command = [
            sys.executable,
            "-m",
            "impala_rl.cli",
            "train",
            f"env.id={spec.env_id}",
            f"seed={seed}",
            f"max_env_steps={spec.steps}",
            "log.console=false",
            *impala_args,
            "--run-dir",
            str(run_dir / "run"),
        ]
    else:
        command = [sys.executable, __file__, "--sb3-train", name, str(seed), str(run_dir)]
        command += ["--steps", str(spec.steps)]
    load = os.getloadavg()[0]  # other work on the machine slows SB3's two threads the most
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    load = max(load, os.getloadavg()[0])
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"{lib} on {name} seed {seed}: exit {proc.returncode}: {tail}")
    score = evaluate(name, lib, run_dir, episodes=spec.episodes)
    return {
        "env": name,
        "lib": lib,
        "seed": seed,
        "wall_s": wall,
        "score": score,
        "load": round(load, 2),
        "episodes": spec.episodes,
        **({"impala_args": impala_args} if lib == "impala" and impala_args else {}),
        **provenance(),
    }


def provenance() -> dict[str, str]:
    """Which machine and code a record comes from: wall times compare only within one
    machine, and records carried over from another session keep saying where they ran."""
    import platform

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next((ln.split(":", 1)[1].strip() for ln in handle if "model name" in ln), cpu)
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE
        ).stdout.strip()
    except OSError:
        commit = ""
    record = {"cpu": cpu, "commit": commit}
    if os.environ.get("OMP_NUM_THREADS"):  # a screen's runs, threads limited (the docstring)
        record["omp_threads"] = os.environ["OMP_NUM_THREADS"]
    return record


def evaluate(name: str, lib: str, run_dir: Path, episodes: int) -> float:
    """Mean return of the run's final policy over deterministic episodes on fresh envs, the
    same seeds for both libraries."""
    spec = ENVS[name]
    if lib == "impala":  # the env as the run made it (MinAtar's own frames, ...)
        from impala_rl import load_policy

        policy = load_policy(run_dir / "run", which="last")
        env = policy.env_factory()

        def act(obs: Any) -> Any:
            return policy.act(obs, deterministic=True)

        reset = policy.reset
    else:
        from stable_baselines3 import PPO

        model = PPO.load(run_dir / "model.zip", device="cpu")
        env = make_env(spec, for_sb3=True)

        def act(obs: Any) -> Any:
            action = model.predict(obs, deterministic=True)[0]
            return int(action) if np.ndim(action) == 0 else action  # Taxi indexes by it

        def reset() -> None:
            return None

    returns = []
    for episode in range(episodes):
        obs, _ = env.reset(seed=10_000 + episode)
        reset()
        total, done, steps = 0.0, False, 0
        while not done and steps < MAX_EVAL_STEPS:
            obs, reward, terminated, truncated, _ = env.step(act(obs))
            total += float(reward)
            done, steps = terminated or truncated, steps + 1
        returns.append(total)
    env.close()
    return float(np.mean(returns))


# -- the study --------------------------------------------------------------------------------
def load_results(out: Path) -> list[dict]:
    path = out / "results.json"
    return json.loads(path.read_text()) if path.is_file() else []


def save_results(out: Path, results: list[dict]) -> None:
    path = out / "results.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(path)


def add_record(out: Path, record: dict) -> list[dict]:
    """Add ``record`` to ``OUT/results.json`` as it is on disk now, under a lock: runs of
    other seeds or envs started into the same OUT keep theirs. Returns every record."""
    import fcntl

    with open(out / "results.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        key = (record["env"], record["lib"], record["seed"])
        results = [r for r in load_results(out) if (r["env"], r["lib"], r["seed"]) != key]
        results.append(record)
        save_results(out, results)
    return results


def table(results: list[dict]) -> str:
    """Per env: median score and wall time of each library over seeds, and the time ratio:
    the median over seeds of each seed's impala-rl / SB3 wall time (a seed's two runs are
    timed in one session on one machine; records carried over from other sessions may come
    from other machines, see ``cpu``)."""
    rows = [
        "| env | kind | steps | seeds | impala-rl score | SB3 score | impala-rl s | SB3 s "
        "| time ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    total = {"impala": 0.0, "sb3": 0.0}
    cpus: set[str] = set()
    for name, spec in ENVS.items():
        by_lib = {
            lib: {r["seed"]: r for r in results if r["env"] == name and r["lib"] == lib}
            for lib in ("impala", "sb3")
        }
        seeds = sorted(set(by_lib["impala"]) & set(by_lib["sb3"]))
        if not seeds:
            continue
        med = {
            lib: {key: statistics.median(rs[s][key] for s in seeds) for key in ("score", "wall_s")}
            for lib, rs in by_lib.items()
        }
        ratio = statistics.median(
            by_lib["impala"][s]["wall_s"] / by_lib["sb3"][s]["wall_s"] for s in seeds
        )
        for lib in total:
            total[lib] += sum(by_lib[lib][s]["wall_s"] for s in seeds)
            cpus.update(by_lib[lib][s].get("cpu", "?") for s in seeds)
        scores = {
            lib: "/".join(f"{rs[s]['score']:.3g}" for s in seeds) for lib, rs in by_lib.items()
        }
        mark = " (tuned)" if spec.tuned else " (held out)"
        rows.append(
            f"| {name}{mark} | {spec.kind} | {spec.steps:,} | {len(seeds)} "
            f"| **{med['impala']['score']:.3g}** ({scores['impala']}) "
            f"| **{med['sb3']['score']:.3g}** ({scores['sb3']}) "
            f"| {med['impala']['wall_s']:.0f} | {med['sb3']['wall_s']:.0f} "
            f"| {ratio:.2f} |"
        )
    if total["sb3"]:
        rows.append(
            f"\nAll runs' wall time: impala-rl {total['impala']:.0f} s, SB3 {total['sb3']:.0f} s, "
            f"ratio {total['impala'] / total['sb3']:.2f}; CPU: {', '.join(sorted(cpus))}"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", nargs="+", default=list(ENVS), choices=list(ENVS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--libs", nargs="+", default=["sb3", "impala"], choices=["sb3", "impala"])
    parser.add_argument("--out", type=Path, default=Path("runs/any-env"))
    parser.add_argument("--impala-args", nargs="*", default=[], help="extra key=value settings")
    parser.add_argument("--steps", type=int, help="every env's budget (a smoke test)")
    parser.add_argument(
        "--episodes",
        type=int,
        help="every env's evaluation episodes (a stochastic env's score to more digits); kept "
        "in each record",
    )
    parser.add_argument("--table", type=Path, help="print the table of a finished OUT and exit")
    parser.add_argument(
        "--carry",
        type=Path,
        help="records of earlier sessions (benchmarks/results/any_env.json) to add to OUT's "
        "before running: what they hold is not run again",
    )
    parser.add_argument(
        "--sb3-train", nargs=3, metavar=("ENV", "SEED", "DIR"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.sb3_train:
        name, seed, run_dir = args.sb3_train
        if args.steps:
            ENVS[name] = dataclasses.replace(ENVS[name], steps=args.steps)
        sb3_train(name, int(seed), Path(run_dir))
        return
    if args.table:
        print(table(load_results(args.table)))
        return
    if args.steps:
        for name, spec in ENVS.items():
            ENVS[name] = dataclasses.replace(spec, steps=args.steps, episodes=2)
    if args.episodes:
        for name, spec in ENVS.items():
            ENVS[name] = dataclasses.replace(spec, episodes=args.episodes)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "command.txt").write_text(" ".join([sys.executable, *sys.argv]) + "\n")
    results = load_results(args.out)
    if args.carry:  # records kept in the repo by an earlier session
        have = {(r["env"], r["lib"], r["seed"]) for r in results}
        # scored over as many episodes as this command scores
        carried = [r for r in json.loads(args.carry.read_text()) if scored_as_now(r)]
        # whole pairs only: a seed's two runs are timed in one session
        libs: dict[tuple[str, int], set[str]] = {}
        for r in carried:
            libs.setdefault((r["env"], r["seed"]), set()).add(r["lib"])
        results += [
            r
            for r in carried
            if (r["env"], r["lib"], r["seed"]) not in have and len(libs[r["env"], r["seed"]]) == 2
        ]
        save_results(args.out, results)
    done = {(r["env"], r["lib"], r["seed"]) for r in results}
    for name in args.envs:
        for seed in args.seeds:
            for lib in args.libs:
                if (name, lib, seed) in done:
                    continue
                record = run_one(name, lib, seed, args.out, args.impala_args)
                print(json.dumps(record), flush=True)
                results = add_record(args.out, record)
    print(table(results))


if __name__ == "__main__":
    main()
