"""The accelerator box's figures in one run (issue 31): env bound, training rate, GPU use.

Prints, for a preset and overrides (default: the README's GPU command, ``pong
algorithm.device=cuda algorithm.num_actors=16 algorithm.actors_batch_size=2
env.kwargs.vector_threads=1``):

(a) the raw env bound of the machine's cores: ``--procs`` processes (default: all cores), each
    stepping one actor's vector env of the preset (``algorithm.envs_per_actor`` copies, built by
    the project's env factory from the preset's ``env`` section, ``env.kwargs.vector_threads=1``)
    with random actions for ``--env-seconds``, started together; env steps/s summed (and
    frames/s, frame skip 4, for Atari);
(b) the training rate: ``python -m impala_rl.cli train PRESET OVERRIDES target_return=null
    max_wall_time_s=--train-seconds`` in a new process, the rate between the first and the last
    epoch of its ``metrics.jsonl``, and the shares of an update's time from the epoch rows'
    ``time_*/percent`` (learner = forward + losses + backward and optimizer; waiting = for the
    actors), averaged over those epochs weighted by their updates;
(c) the ratio (b) / (a);
(d) GPU utilisation and memory while (b) trains (``nvidia-smi`` every second; "no GPU" without
    it), between the first and the last epoch and over the whole process.

With ``runner.inference=central``, (b) also prints the inference servers' own figures from
their closing log lines: requests per batch, milliseconds per batch, busy and weight-loading
shares (over ``runner.inference_servers`` servers: per batch weighted, shares averaged).

``--vs 'key=value ...'`` (repeatable) trains again with those overrides added, in the same
call, and ends with every variant's ratio side by side; (a) is measured once per
envs-per-actor count among them.

Evaluation is cut to one step of one episode (``algorithm.rollout_evaluator.*``) and, unless
the overrides set it, ``algorithm.epoch_length`` is chosen for ~50 epochs if training ran at
the env bound (a), ~10 at a fifth of it; overrides given here win over both. ``--out FILE``
writes every figure as JSON (``-``: to stdout). On one GPU and 16 cores the defaults take ~4-5
minutes.

    python benchmarks/gpu_box.py --out runs/gpu-box.json
    python benchmarks/gpu_box.py pong algorithm.device=cuda algorithm.num_actors=16 \\
        algorithm.actors_batch_size=4 env.kwargs.vector_threads=1
    python benchmarks/gpu_box.py --procs 2 --env-seconds 10 --train-seconds 40 \\
        pong algorithm.device=cpu algorithm.num_actors=1            # a CPU-only check
    python benchmarks/gpu_box.py --env-seconds 10 --train-seconds 60 \\
        --vs 'runner.inference_servers=2' pong algorithm.device=cuda algorithm.num_actors=16 \\
        algorithm.actors_batch_size=2 env.kwargs.vector_threads=1 runner.inference=central
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

DEFAULT_PRESET = "pong"
DEFAULT_OVERRIDES = [
    "algorithm.device=cuda",
    "algorithm.num_actors=16",
    "algorithm.actors_batch_size=2",
    "env.kwargs.vector_threads=1",
]
# Before the user's overrides (theirs win): evaluation is not what this measures.
TRAIN_DEFAULTS = [
    "algorithm.rollout_evaluator.n_episodes=1",
    "algorithm.rollout_evaluator.max_episode_steps=1",
    "log.console=false",
    "log.tensorboard=false",
]
EPOCHS_AT_BOUND = 50  # epochs in --train-seconds if training ran at the env bound
SETUP_TIMEOUT_S = 180.0  # for the env processes to import and build their envs
STOP_GRACE_S = 30.0  # for the trainer to stop its actors after SIGTERM
LEARNER_PARTS = ("time_learner_rollout", "time_loss_computation", "time_backprob")
SMI_QUERY = ["--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits"]


# (a) the env bound ---------------------------------------------------------------------------


def _env_worker(index: int, env_cfg: Any, n_envs: int, seconds: float, barrier, results) -> None:
    """Step one actor's vector env with random actions for ``seconds`` after the barrier."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the workers
    import numpy as np

    from impala_rl.envs import make_env_factory, make_vector_env

    envs = None
    try:
        envs = make_vector_env(make_env_factory(env_cfg), n_envs)
        envs.reset(seed=index)
        space = envs.single_action_space
        space.seed(index)
        actions = np.stack([np.stack([space.sample() for _ in range(n_envs)]) for _ in range(64)])
        envs.step(actions[0])  # first-step costs out of the timing
        barrier.wait(timeout=SETUP_TIMEOUT_S)
        steps, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            envs.step(actions[steps % len(actions)])
            steps += 1
        results.put((index, steps * n_envs, elapsed, None))
    except BaseException:
        barrier.abort()  # the others stop waiting
        results.put((index, 0, 0.0, traceback.format_exc()))
    finally:
        if envs is not None:
            envs.close()


def env_bound(env_cfg: Any, n_envs: int, procs: int, seconds: float) -> dict[str, Any]:
    """``procs`` processes stepping ``n_envs`` envs each, started together: env steps/s summed."""
    ctx = mp.get_context("spawn")  # fresh interpreters: nothing of this process's state
    barrier, results = ctx.Barrier(procs), ctx.Queue()
    workers = [
        ctx.Process(
            target=_env_worker,
            args=(i, env_cfg, n_envs, seconds, barrier, results),
            name=f"gpu-box-env-{i}",
            daemon=True,
        )
        for i in range(procs)
    ]
    try:
        for worker in workers:
            worker.start()
        deadline = time.monotonic() + SETUP_TIMEOUT_S + seconds + 60
        rows, errors = [], []
        while len(rows) + len(errors) < procs:
            try:
                index, steps, elapsed, error = results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise SystemExit("env bound: the env processes did not finish") from None
                if any(w.exitcode not in (None, 0) for w in workers) and results.empty():
                    dead = [w.name for w in workers if w.exitcode not in (None, 0)]
                    raise SystemExit(f"env bound: {', '.join(dead)} died") from None
                continue
            if error is None:
                rows.append((index, steps, elapsed))
            elif "BrokenBarrierError" not in error:
                errors.append(f"process {index}:\n{error}")
        if errors:
            raise SystemExit("env bound failed:\n" + "\n".join(errors))
        for worker in workers:
            worker.join(timeout=30)
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
        for worker in workers:
            if worker.pid is not None:
                worker.join(timeout=10)
                if worker.is_alive():
                    worker.kill()
                    worker.join()
        results.close()
        results.join_thread()
    rates = [steps / elapsed for _, steps, elapsed in sorted(rows)]
    return {
        "procs": procs,
        "envs_per_proc": n_envs,
        "seconds": seconds,
        "env_steps_per_s": sum(rates),
        "per_proc_env_steps_per_s": rates,
    }


# (d) GPU utilisation ---------------------------------------------------------------------------


class GpuSampler:
    """``nvidia-smi`` every ``period`` seconds in a thread: (time, [(util %, MiB) per GPU])."""

    def __init__(self, period: float = 1.0):
        self.period = period
        self.samples: list[tuple[float, list[tuple[float, float]]]] = []
        self.smi = shutil.which("nvidia-smi")
        self.error: str | None = None if self.smi else "nvidia-smi not found"
        self.names: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-box-smi", daemon=True)

    def _query(self, *args: str) -> list[str]:
        out = subprocess.run(
            [self.smi, *args], capture_output=True, text=True, timeout=10, check=True
        ).stdout
        return [line.strip() for line in out.splitlines() if line.strip()]

    def start(self) -> GpuSampler:
        if self.smi is None:
            return self
        try:
            self.names = self._query("--query-gpu=name", "--format=csv,noheader")
        except (subprocess.SubprocessError, OSError) as exc:
            self.error = f"nvidia-smi failed: {exc}"
            return self
        if not self.names:
            self.error = "nvidia-smi lists no GPU"
            return self
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                lines = self._query(*SMI_QUERY)
                per_gpu = [tuple(float(x) for x in line.split(",")[:2]) for line in lines]
                self.samples.append((t, per_gpu))  # type: ignore[arg-type]
            except (subprocess.SubprocessError, OSError, ValueError) as exc:
                self.error = f"nvidia-smi failed: {exc}"
            self._stop.wait(max(0.0, self.period - (time.monotonic() - t)))

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=15)

    def summary(self, start: float | None = None, end: float | None = None) -> dict | None:
        """Mean and max utilisation and max memory per GPU over samples in [start, end]."""
        window = [
            per_gpu
            for t, per_gpu in self.samples
            if (start is None or t >= start) and (end is None or t <= end)
        ]
        if not window:
            return None
        gpus = []
        for g in range(min(len(p) for p in window)):
            util = [p[g][0] for p in window]
            gpus.append(
                {
                    "util_mean": sum(util) / len(util),
                    "util_max": max(util),
                    "memory_max_mib": max(p[g][1] for p in window),
                }
            )
        return {"samples": len(window), "gpus": gpus}


# (b) the training rate ---------------------------------------------------------------------------


def _stop_trainer(proc: subprocess.Popen) -> None:
    """Stop a trainer started in its own session, then anything left in its process group."""
    if proc.poll() is None:
        proc.terminate()  # the trainer stops its actors and checkpoints on SIGTERM
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, 0)  # anyone left in the group (actors, the forkserver)?
        except (ProcessLookupError, PermissionError):
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:  # they may be on their way out
            try:
                os.killpg(proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.2)
        else:
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _last_epoch(path: Path) -> int | None:
    try:
        with path.open("rb") as handle:
            handle.seek(max(0, path.stat().st_size - 65536))
            lines = handle.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["epoch"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def time_shares(rows: list[dict]) -> dict[str, float | None]:
    """Shares (%) of an update's time and its mean seconds over ``rows[1:]`` (the epochs the
    rate covers), each epoch weighted by its updates; with one epoch, that epoch's."""
    pairs = []
    for before, row in zip(rows, rows[1:], strict=False):
        updates = row.get("total_updates", 0) - before.get("total_updates", 0)
        pairs.append((row, updates if updates > 0 else 1))
    pairs = pairs or [(row, 1) for row in rows[:1]]

    def mean(key: str) -> float | None:
        values = [(row[key], w) for row, w in pairs if row.get(key) is not None]
        if not values:
            return None
        return sum(v * w for v, w in values) / sum(w for _, w in values)

    shares = {part: mean(f"{part}/percent") for part in LEARNER_PARTS}
    learner = None if None in shares.values() else sum(shares.values())  # type: ignore[arg-type]
    waiting = mean("time_collecting_actors/percent")
    dequeue = mean("time_dequeuing_actors/percent")
    known = [learner, waiting, dequeue]
    return {
        "update_s": mean("time_update"),
        "learner_percent": learner,
        **{f"{part[5:]}_percent": value for part, value in shares.items()},
        "waiting_for_actors_percent": waiting,
        "dequeuing_percent": dequeue,
        "other_percent": None if None in known else 100.0 - sum(known),  # type: ignore[arg-type]
        "policy_lag_mean": mean("policy_lag/mean"),
    }


def train(
    preset: str, overrides: list[str], seconds: float, run_dir: Path, sampler: GpuSampler
) -> dict[str, Any]:
    from pong_throughput import rate_between_epochs  # benchmarks/ (this script's folder)

    from impala_rl.plot import load_metrics

    command = [
        sys.executable,
        *("-m", "impala_rl.cli", "train", preset),
        *TRAIN_DEFAULTS,
        *overrides,
        "target_return=null",
        f"max_wall_time_s={seconds:g}",
        *("--run-dir", str(run_dir)),
    ]
    log, metrics = run_dir.parent / f"{run_dir.name}.train.log", run_dir / "metrics.jsonl"
    epoch_seen: dict[int, float] = {}  # epoch -> when its row appeared (monotonic)
    with log.open("w") as handle:
        handle.write(f"$ {shlex.join(command)}\n")
        handle.flush()
        start = time.monotonic()
        sampler.start()
        proc = subprocess.Popen(
            command,
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its group holds its actors: stopped together below
        )
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                epoch = _last_epoch(metrics)
                if epoch is not None and epoch not in epoch_seen:
                    epoch_seen[epoch] = time.monotonic()
        finally:
            _stop_trainer(proc)
            sampler.stop()
        wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"training failed ({proc.returncode}):\n{log.read_text()[-4000:]}")
    rows = load_metrics(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    server = server_figures(log.read_text())
    rate = rate_between_epochs(str(run_dir))
    first = epoch_seen.get(rows[0]["epoch"]) if rows else None
    last = epoch_seen.get(rows[-1]["epoch"]) if len(rows) > 1 else None
    return {
        "command": shlex.join(command),
        "env_steps_per_s": rate,
        "rate_from": "between the first and last epoch" if rate is not None else None,
        "whole_process_env_steps_per_s": summary["env_steps"] / wall,
        "process_wall_s": wall,
        "epochs": len(rows),
        "between_epochs_s": rows[-1]["wall_time_s"] - rows[0]["wall_time_s"] if rows else None,
        "summary": summary,
        "time_shares": time_shares(rows),
        "gpu_steady": sampler.summary(first, last) if first and last else None,
        "gpu_whole_process": sampler.summary(),
        "inference_server": server,
    }


SERVER_LINE = re.compile(
    r"inference\s+server(\s+\d+\s+of\s+\d+|\s+\(in\s+the\s+learner's\s+process\))?:"
    r"\s+(?P<batches>\d+)\s+batches\s+of\s+"
    r"(?P<requests>[\d.]+)\s+requests,\s+(?P<ms>[\d.]+)\s+ms\s+each;\s+busy\s+(?P<busy>\d+)%"
    r"\s+of\s+the\s+time,\s+loading\s+weights\s+(?P<loading>\d+)%"
)


def server_figures(log_text: str) -> dict[str, Any] | None:
    """Central inference's closing lines in a training log (wrapped by the console or not),
    over every server: batches summed, per-batch figures weighted by batches, shares
    averaged; ``per_server`` keeps each line's."""
    text = re.sub(r"\s*\n\s*(INFO\s+)?", " ", log_text)
    servers = [
        {
            "batches": int(m["batches"]),
            "requests_per_batch": float(m["requests"]),
            "ms_per_batch": float(m["ms"]),
            "busy_percent": float(m["busy"]),
            "loading_weights_percent": float(m["loading"]),
        }
        for m in SERVER_LINE.finditer(text)
    ]
    if not servers:
        return None
    batches = sum(s["batches"] for s in servers)

    def per_batch(key: str) -> float:
        return sum(s[key] * s["batches"] for s in servers) / max(1, batches)

    def mean(key: str) -> float:
        return sum(s[key] for s in servers) / len(servers)

    return {
        "servers": len(servers),
        "batches": batches,
        "requests_per_batch": per_batch("requests_per_batch"),
        "ms_per_batch": per_batch("ms_per_batch"),
        "busy_percent": mean("busy_percent"),
        "loading_weights_percent": mean("loading_weights_percent"),
        "per_server": servers,
    }


# the run -----------------------------------------------------------------------------------------


def _frames_per_step(env_cfg: Any) -> int | None:
    if "atari" not in env_cfg.id and not env_cfg.id.startswith("ALE/"):
        return None
    return int(env_cfg.kwargs.get("frame_skip", 4))


def _fmt(value: float | None, spec: str = ".0f", unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def _print_gpu(label: str, gpu: dict | None, sampler: GpuSampler) -> None:
    if gpu is None:
        print(f"  {label}: {sampler.error or 'no samples'}")
        return
    for i, g in enumerate(gpu["gpus"]):
        name = f"GPU {i}" + (f" ({sampler.names[i]})" if i < len(sampler.names) else "")
        print(
            f"  {label}, {name}: utilisation mean {g['util_mean']:.0f}%, max "
            f"{g['util_max']:.0f}%; memory max {g['memory_max_mib']:,.0f} MiB "
            f"({gpu['samples']} samples)"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", help=f"the preset (default {DEFAULT_PRESET})")
    parser.add_argument("--procs", type=int, default=os.cpu_count(), help="env processes in (a)")
    parser.add_argument("--env-seconds", type=float, default=30.0, help="stepping time in (a)")
    parser.add_argument("--train-seconds", type=float, default=180.0, help="max_wall_time_s of (b)")
    parser.add_argument("--run-dir", type=Path, help="keep the training run here (default: temp)")
    parser.add_argument("--out", help="write every figure as JSON here ('-': stdout)")
    parser.add_argument(
        "--vs",
        action="append",
        default=[],
        metavar="'key=value ...'",
        help="then train again with these overrides added (repeatable); (a) is measured once "
        "per envs-per-actor count",
    )
    parser.add_argument(
        "items",
        nargs="*",
        metavar="[PRESET] key=value",
        help=f"the preset and its overrides; with none: {' '.join(DEFAULT_OVERRIDES)}",
    )
    args = parser.parse_args(argv)
    items = list(args.items)
    if items and "=" not in items[0]:
        if args.preset and args.preset != items[0]:
            parser.error(f"two presets: --preset {args.preset} and {items[0]}")
        args.preset = items.pop(0)
    args.preset = args.preset or DEFAULT_PRESET
    args.overrides = items if args.items else list(DEFAULT_OVERRIDES)
    if args.procs is None or args.procs < 1:
        parser.error("--procs must be >= 1")
    return args


def _bound_for(args: argparse.Namespace, cfg: Any, bounds: dict[int, dict]) -> dict[str, Any]:
    """(a) for ``cfg``'s envs per actor, measured once per envs-per-actor count."""
    env_cfg = cfg.env
    if "vector_threads" in env_cfg.kwargs:  # one stepping thread per process: one core each
        env_cfg.kwargs = {**env_cfg.kwargs, "vector_threads": 1}
    n_envs = cfg.algorithm.envs_per_actor
    if n_envs in bounds:
        return bounds[n_envs]
    frames = _frames_per_step(env_cfg)
    print(
        f"(a) env bound: {args.procs} processes x {n_envs} envs of {args.preset}'s env "
        f"({env_cfg.id}, {dict(env_cfg.kwargs)}), random actions, {args.env_seconds:g} s",
        flush=True,
    )
    bound = env_bound(env_cfg, n_envs, args.procs, args.env_seconds)
    rate_a = bound["env_steps_per_s"]
    bound["frames_per_s"] = rate_a * frames if frames else None
    per = bound["per_proc_env_steps_per_s"]
    print(
        f"    {rate_a:,.0f} env steps/s"
        + (f" ({rate_a * frames:,.0f} frames/s)" if frames else "")
        + f"; per process {min(per):,.0f}-{max(per):,.0f}",
        flush=True,
    )
    bounds[n_envs] = bound
    return bound


def measure(
    args: argparse.Namespace, overrides: list[str], bounds: dict[int, dict], run_dir: Path | None
) -> dict[str, Any]:
    """(a) (when not measured yet for these envs per actor) to (d) for one set of overrides."""
    from impala_rl.env_defaults import resolve_config

    cfg = resolve_config(args.preset, overrides)  # as `impala train` has it: sized to the box
    bound = _bound_for(args, cfg, bounds)
    rate_a = bound["env_steps_per_s"]
    frames = _frames_per_step(cfg.env)
    overrides = list(overrides)
    if not any(o.startswith("algorithm.epoch_length=") for o in overrides):
        alg = cfg.algorithm
        steps_per_update = alg.n_rollout_steps * alg.envs_per_actor * alg.actors_batch_size
        updates = rate_a * args.train_seconds / EPOCHS_AT_BOUND / steps_per_update
        overrides.insert(0, f"algorithm.epoch_length={max(1, round(updates))}")
    print(
        f"(b) training: {args.preset} {' '.join(overrides)} for {args.train_seconds:g} s",
        flush=True,
    )
    sampler = GpuSampler()
    with tempfile.TemporaryDirectory(prefix="impala-gpu-box-") as tmp:
        run_dir = run_dir or Path(tmp, "run")
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        training = train(args.preset, overrides, args.train_seconds, run_dir, sampler)
    rate_b, shares = training["env_steps_per_s"], training["time_shares"]
    alg_steps = training["summary"]["env_steps"]
    if rate_b is None:
        rate_b = training["whole_process_env_steps_per_s"]
        print("    (fewer than two epochs: the whole process's rate, start-up included)")
    training["frames_per_s"] = rate_b * frames if frames else None
    print(
        f"    {rate_b:,.0f} env steps/s"
        + (f" ({rate_b * frames:,.0f} frames/s)" if frames else "")
        + f" over {training['epochs']} epochs ({_fmt(training['between_epochs_s'], '.0f')} s "
        f"between the first and last; {alg_steps:,} env steps in all); whole process "
        f"{training['whole_process_env_steps_per_s']:,.0f} in {training['process_wall_s']:.0f} s",
        flush=True,
    )
    print(
        f"    update {_fmt(shares['update_s'] and shares['update_s'] * 1e3, '.1f', ' ms')}: "
        f"learner {_fmt(shares['learner_percent'], '.0f', '%')} (forward "
        f"{_fmt(shares['learner_rollout_percent'], '.0f', '%')}, losses "
        f"{_fmt(shares['loss_computation_percent'], '.0f', '%')}, backward+optimizer "
        f"{_fmt(shares['backprob_percent'], '.0f', '%')}), waiting for actors "
        f"{_fmt(shares['waiting_for_actors_percent'], '.0f', '%')}, dequeuing "
        f"{_fmt(shares['dequeuing_percent'], '.1f', '%')}, other "
        f"{_fmt(shares['other_percent'], '.0f', '%')}; policy lag "
        f"{_fmt(shares['policy_lag_mean'], '.1f')} updates",
        flush=True,
    )
    server = training["inference_server"]
    if server is not None:
        print(
            f"    inference ({server['servers']} server(s)): "
            f"{server['requests_per_batch']:.1f} requests per batch, "
            f"{server['ms_per_batch']:.2f} ms each, busy {server['busy_percent']:.0f}%, "
            f"loading weights {server['loading_weights_percent']:.0f}%",
            flush=True,
        )
    ratio = rate_b / rate_a if rate_a > 0 else None
    print(f"(c) training / env bound: {_fmt(ratio, '.2f')}")
    print("(d) GPU while training:")
    if sampler.smi is None or not sampler.names:
        print(f"  no GPU ({sampler.error})")
    else:
        _print_gpu("between the first and last epoch", training["gpu_steady"], sampler)
        _print_gpu("whole training process", training["gpu_whole_process"], sampler)
    return {
        "overrides": overrides,
        "env_bound": bound,
        "training": training,
        "training_env_steps_per_s": rate_b,  # the whole process's with fewer than two epochs
        "ratio": ratio,
        "gpus": sampler.names,
        "gpu": {
            "available": bool(sampler.names),
            "error": sampler.error,
            "steady": training["gpu_steady"],
            "whole_process": training["gpu_whole_process"],
        },
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    bounds: dict[int, dict] = {}
    first = measure(args, args.overrides, bounds, args.run_dir)
    variants = []
    for extra in args.vs:
        print(f"--vs {extra}", flush=True)
        variants.append(measure(args, [*args.overrides, *shlex.split(extra)], bounds, None))
    if variants:
        print("training / env bound:")
        for name, result in [("the overrides", first), *zip(args.vs, variants, strict=True)]:
            rate = result["training_env_steps_per_s"]
            print(f"  {_fmt(result['ratio'], '.2f')} ({rate:,.0f} env steps/s): {name}")
    total = time.monotonic() - t0
    print(f"total {total:.0f} s", flush=True)
    return {
        "preset": args.preset,
        "command": shlex.join(["python", "benchmarks/gpu_box.py", *sys.argv[1:]]),
        "cpu_count": os.cpu_count(),
        **first,
        "overrides": args.overrides,
        "variants": [{"vs": extra, **v} for extra, v in zip(args.vs, variants, strict=True)],
        "total_wall_s": total,
    }


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that stop processes


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with `&`
    try:
        result = run(args)
    except KeyboardInterrupt:
        raise SystemExit(128 + signal.SIGINT) from None
    if args.out == "-":
        print(json.dumps(result, indent=2))
    elif args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
