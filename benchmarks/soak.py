"""Soak: train for a long time while actors and the trainer itself are killed, and check that
nothing is lost that should not be, nothing leaks and the policy still learns.

One ``impala train`` process (a new session, so everything it starts can be found) runs the
``cartpole`` preset (``key=value`` overrides after the options apply to it) with
``target_return=null`` for ``--minutes``, or until the run's own ``max_env_steps`` budget ends
it (then the uninterrupted run has the same lr schedule). Every ``--actor-kill-every``
seconds one actor process is SIGKILLed (the backend must restart it); every
``--trainer-kill-every`` seconds the trainer is SIGKILLed and ``impala train --resume`` starts
it again. At the end the run is stopped with SIGINT, and

- restarts and rollouts lost (the ``actor_restarts`` and ``lost_rollouts`` events) are summed
  over ``metrics.jsonl``;
- the env steps lost to each trainer kill: the progress of the last epoch line written before
  the kill minus the checkpoint it resumed from;
- resident memory (RSS) of the trainer and of the actors, 60 s into each trainer segment and
  just before it ends (growth per segment: <= 5% is the target);
- processes left over in any session the soak started, and project files left in /dev/shm (0);
- the final policy's evaluation against an uninterrupted run trained to the same env steps
  (afterwards, or with ``--baseline-alongside`` at the same time, to the same budget).

    PYTHONPATH=src python benchmarks/soak.py                          # 30 min, subprocess
    PYTHONPATH=src python benchmarks/soak.py --backend ray --minutes 10
    PYTHONPATH=src python benchmarks/soak.py --minutes 3 --actor-kill-every 20 \
        --trainer-kill-every 70
    PYTHONPATH=src python benchmarks/soak.py --minutes 45 algorithm.lr=5e-4 \
        algorithm.lr_schedule=linear max_env_steps=700000    # a stable run: lr decays to 0

It prints one JSON report (and writes it to ``RUN_DIR/soak.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from impala_rl import checkpoint

PAGE = os.sysconf("SC_PAGE_SIZE")


def _proc_stat(pid: int) -> tuple[int, int, str] | None:
    """``(ppid, session id, state)`` of a live process, None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[3]), fields[0]


def session_pids(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        st = _proc_stat(int(entry.name))
        if st is not None and st[1] == sid and st[2] != "Z":
            pids.append(int(entry.name))
    return pids


def rss_mib(pid: int) -> float:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE / 2**20
    except OSError:
        return 0.0


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def actor_pids(trainer: int) -> list[int]:
    """The trainer's actor processes: the forkserver's children (subprocess backend) or Ray's
    actor workers (``ray::<ActorClass>``) in the trainer's session."""
    pids = session_pids(trainer)
    forkservers = {p for p in pids if "multiprocessing.forkserver" in cmdline(p)}
    ray_helpers = ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent")
    actors = []
    for pid in pids:
        st, text = _proc_stat(pid), cmdline(pid)
        if st is not None and st[0] in forkservers:
            actors.append(pid)
        elif text.startswith("ray::") and not text.startswith(ray_helpers):
            actors.append(pid)
    return actors


def memory(trainer: int) -> dict[str, float]:
    return {
        "trainer_mib": round(rss_mib(trainer), 1),
        "actors_mib": round(sum(rss_mib(p) for p in actor_pids(trainer)), 1),
    }


def last_metrics(run_dir: Path) -> dict:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return json.loads(lines[-1]) if lines else {}


def shm_files() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir()} if shm.is_dir() else set()


def start(command: list[str], log) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "impala_rl.cli", *command],
        stdout=log,
        stderr=log,
        start_new_session=True,
    )


def stop_session(proc: subprocess.Popen, sig: int, timeout: float = 60) -> list[int]:
    """Send ``sig`` (0: none) to the trainer, wait for it; returns the pids of its session
    still alive 10 s later (then kills them, so the soak itself leaves nothing)."""
    if sig:
        os.kill(proc.pid, sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 10
    while session_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = session_pids(proc.pid)
    if left:
        os.killpg(proc.pid, signal.SIGKILL)
    return left


def evaluate(run_dir: Path, which: str, episodes: int) -> float:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "impala_rl.cli",
            "eval",
            str(run_dir),
            "--which",
            which,
            "--episodes",
            str(episodes),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out)["mean_return"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--actor-kill-every", type=float, default=60.0, metavar="SECONDS")
    parser.add_argument("--trainer-kill-every", type=float, default=600.0, metavar="SECONDS")
    parser.add_argument("--backend", choices=("subprocess", "ray"), default="subprocess")
    parser.add_argument("--preset", default="cartpole")
    parser.add_argument("--eval-episodes", type=int, default=20)
    parser.add_argument("--run-dir", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--baseline-alongside",
        action="store_true",
        help="train the uninterrupted run at the same time (needs a max_env_steps override "
        "that ends the soak before --minutes)",
    )
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="soak-"))
    settings = [
        f"runner.backend={args.backend}",
        "runner.max_actor_restarts=1000",
        "target_return=null",
        "log.tensorboard=false",
        "log.console=false",
        "log.checkpoint_every_epochs=1",
        f"seed={args.seed}",
        *args.overrides,
    ]
    shm_before = shm_files()
    log = open(run_dir.parent / f"{run_dir.name}.log", "a")  # noqa: SIM115
    t_end = time.monotonic() + 60 * args.minutes
    segments: list[dict] = []
    actor_kills = 0
    leftovers: list[int] = []
    command = ["train", args.preset, "--run-dir", str(run_dir), *settings]
    baseline_dir = run_dir.parent / f"{run_dir.name}-uninterrupted"
    baseline = None
    if args.baseline_alongside:
        baseline = subprocess.Popen(
            [sys.executable, "-m", "impala_rl.cli", "train", args.preset, "--run-dir"]
            + [str(baseline_dir), *settings],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    while True:
        proc = start(command, log)
        seg_start = time.monotonic()
        segment: dict = {"resumed_from_env_steps": None}
        last_pt = run_dir / "checkpoints" / "last.pt"
        if segments:
            segment["resumed_from_env_steps"] = checkpoint.load(last_pt)["counters"]["env_steps"]
        next_actor_kill = seg_start + args.actor_kill_every
        seg_end = min(t_end, seg_start + args.trainer_kill_every)
        budget_done = False
        while time.monotonic() < seg_end:
            if proc.poll() is not None:
                summary = run_dir / "summary.json"
                if proc.returncode == 0 and summary.is_file():
                    if json.loads(summary.read_text())["stopped_because"] == "max_env_steps":
                        budget_done = True
                        break
                raise SystemExit(
                    f"the trainer exited by itself ({proc.returncode}); see {log.name}"
                )
            now = time.monotonic()
            if "memory_start" not in segment and now - seg_start >= min(
                60, args.actor_kill_every / 2
            ):
                segment["memory_start"] = memory(proc.pid)
            if "memory_start" in segment and now >= segment.get("memory_next", 0):
                segment["memory_last"] = memory(proc.pid)  # the end's, if the budget ends it
                segment["memory_next"] = now + 10
            if now >= next_actor_kill:
                actors = actor_pids(proc.pid)
                if actors:
                    os.kill(rng.choice(actors), signal.SIGKILL)
                    actor_kills += 1
                next_actor_kill = now + args.actor_kill_every
            time.sleep(0.5)
        final = budget_done or time.monotonic() >= t_end
        if budget_done:
            segment["memory_end"] = segment.get("memory_last", segment.get("memory_start"))
            leftovers += stop_session(proc, 0)
        else:
            segment["memory_end"] = memory(proc.pid)
        before_kill = last_metrics(run_dir).get("total_env_steps", 0)
        if not budget_done:
            leftovers += stop_session(proc, signal.SIGINT if final else signal.SIGKILL)
        saved = checkpoint.load(last_pt)["counters"]["env_steps"]
        segment["env_steps_lost"] = 0 if final else max(0, before_kill - saved)
        segment["env_steps_at_end"] = saved
        segments.append(segment)
        if final:
            break
        command = ["train", "--resume", str(run_dir)]
    log.close()

    rows = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    env_steps = checkpoint.load(run_dir / "checkpoints" / "last.pt")["counters"]["env_steps"]
    if baseline is not None:
        if not budget_done:
            baseline.kill()
            raise SystemExit("--baseline-alongside: the soak ended before its max_env_steps")
        if baseline.wait() != 0:
            raise SystemExit(f"the uninterrupted run failed ({baseline.returncode})")
    else:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "impala_rl.cli",
                "train",
                args.preset,
                "--run-dir",
                str(baseline_dir),
                *settings,
                f"max_env_steps={env_steps}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=True,
        )
    growth = [
        round(100 * (s["memory_end"][k] / s["memory_start"][k] - 1), 1)
        for s in segments
        if s.get("memory_start") and s.get("memory_end")
        for k in ("trainer_mib",)
        if s["memory_start"][k] > 0
    ]
    report = {
        "backend": args.backend,
        "minutes": args.minutes,
        "run_dir": str(run_dir),
        "trainer_kills": len(segments) - 1,
        "actor_kills": actor_kills,
        "actor_restarts": sum(r.get("actor_restarts", 0) or 0 for r in rows),
        "lost_rollouts": sum(r.get("lost_rollouts", 0) or 0 for r in rows),
        "env_steps": env_steps,
        "env_steps_lost_to_trainer_kills": [s["env_steps_lost"] for s in segments[:-1]],
        "memory_per_segment": [
            {"start": s.get("memory_start"), "end": s["memory_end"]} for s in segments
        ],
        "trainer_rss_growth_pct_per_segment": growth,
        "processes_left": len(leftovers),
        "shm_files_left": len(shm_files() - shm_before),
        "final_eval_mean_return": evaluate(run_dir, "last", args.eval_episodes),
        "uninterrupted_env_steps": checkpoint.load(baseline_dir / "checkpoints" / "last.pt")[
            "counters"
        ]["env_steps"],
        "uninterrupted_eval_mean_return": evaluate(baseline_dir, "last", args.eval_episodes),
    }
    (run_dir / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
