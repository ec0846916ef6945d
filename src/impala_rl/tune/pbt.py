"""Population-based training (Jaderberg et al. 2017; the IMPALA paper tuned DMLab-30 with it).

A population of ``population`` members trains side by side, each an ordinary run directory
(``members/<i>``) with its own seed (the study's seed + i) and values of the searched keys,
drawn at the start from the space. Every ``interval`` env steps (a round; each member ends it
with a checkpoint and an evaluation of its final weights) the members are ranked by the
objective: each of the bottom ``quantile`` takes a top-``quantile`` member's checkpoints
(weights, optimizer state, counters: exploit) and that member's values, each moved by a factor
of 0.8 or 1.2 (a choice drawn again with probability 0.25: explore), then all train on.
``exploit=False`` trains the same members without either: the baseline PBT is measured
against.

``population.json`` records every round: each member's values, score and parent; a rerun of
the same command continues from it (a member that had finished its round is not run again, one
that had not resumes from its checkpoint), and ``population.png`` plots the scores and values
by round with each exploit drawn as a line from its parent.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from impala_rl.config import ConfigError
from impala_rl.group_signals import detach_output_on_hangup, stop_signals
from impala_rl.rundir import lock_run_dir
from impala_rl.tune.runs import TrainingRun, finite, is_statistic
from impala_rl.tune.space import Param, overrides_of, parse_space

log = logging.getLogger(__name__)

PERTURB = (0.8, 1.2)
RESAMPLE_PROBABILITY = 0.25


@dataclass
class PopulationSettings:
    """What a population trains and how (``population.json``'s ``settings``)."""

    preset: str | None
    overrides: list[str]
    space: list[str]
    population: int = 4
    steps: int = 500_000
    interval: int = 50_000
    quantile: float = 0.25
    jobs: int = 1
    seed: int = 0
    objective: str = "eval_return/mean"
    exploit: bool = True
    study_dir: str = "runs/pbt"

    def key(self) -> dict[str, Any]:
        data = asdict(self)
        for name in ("jobs", "study_dir"):
            data.pop(name)
        return data


def check_population(s: PopulationSettings) -> list[Param]:
    """Everything a population needs, refused before anything starts, naming the field."""
    if s.population < 2:
        raise ConfigError(f"tune.population: {s.population}; valid: an integer >= 2")
    if not 0 < s.quantile <= 0.5:
        raise ConfigError(f"tune.quantile: {s.quantile}; valid: a number in (0, 0.5]")
    if s.interval < 1 or s.steps < s.interval:
        raise ConfigError(
            f"tune.interval: {s.interval} with tune.steps {s.steps}; valid: 1 <= interval <= steps"
        )
    if s.jobs < 1:
        raise ConfigError(f"tune.jobs: {s.jobs}; valid: an integer >= 1")
    if not is_statistic(s.objective):
        raise ConfigError(f"tune.objective: no run reports {s.objective!r}")
    return parse_space(s.space, s.preset, [*s.overrides, f"max_env_steps={s.steps}"])


def sample(param: Param, rng: random.Random) -> Any:
    """A value of ``param`` drawn from its distribution."""
    if param.kind == "choice":
        return rng.choice(param.choices)
    if param.log:
        value = math.exp(rng.uniform(math.log(param.low), math.log(param.high)))  # type: ignore[arg-type]
    else:
        value = rng.uniform(param.low, param.high)  # type: ignore[arg-type]
    return int(round(value)) if param.kind in ("int", "intlog") else value


def perturb(param: Param, value: Any, rng: random.Random) -> Any:
    """Explore: a number moved by a factor of 0.8 or 1.2 within its range; a choice drawn
    again with probability :data:`RESAMPLE_PROBABILITY`."""
    if param.kind == "choice":
        return rng.choice(param.choices) if rng.random() < RESAMPLE_PROBABILITY else value
    moved = min(max(value * rng.choice(PERTURB), param.low), param.high)  # type: ignore[type-var]
    return int(round(moved)) if param.kind in ("int", "intlog") else moved


def exploit_and_explore(
    scores: list[float],
    values: list[dict[str, Any]],
    space: list[Param],
    quantile: float,
    rng: random.Random,
) -> list[tuple[int, int, dict[str, Any]]]:
    """``(member, parent, new values)`` for each bottom-quantile member: a top-quantile
    parent's values, perturbed. Members without a score rank last."""
    n = len(scores)
    k = max(1, int(n * quantile))
    order = sorted(range(n), key=lambda i: scores[i] if finite(scores[i]) else -math.inf)
    bottom, top = order[:k], order[-k:]
    out = []
    for member in bottom:
        parent = rng.choice(top)
        new = {p.key: perturb(p, values[parent][p.key], rng) for p in space}
        out.append((member, parent, new))
    return out


class Population:
    """A population in ``settings.study_dir``: start or continue it, train it round by round."""

    def __init__(self, settings: PopulationSettings):
        self.s = settings
        self.space = check_population(settings)
        self.dir = Path(settings.study_dir)
        self.state_path = self.dir / "population.json"
        self._stopping = threading.Event()
        self._runs: set[TrainingRun] = set()
        self._lock = threading.Lock()

    def member_dir(self, i: int) -> Path:
        return self.dir / "members" / str(i)

    # -- state ---------------------------------------------------------------------------------
    def _load_state(self) -> dict[str, Any]:
        if self.state_path.is_file():
            state = json.loads(self.state_path.read_text())
            if state["settings"] != self.s.key():
                raise ConfigError(
                    f"--study-dir {str(self.dir)!r} holds a population with other settings; "
                    "rerun it as it was, or use another --study-dir"
                )
            return state
        rng = random.Random(self.s.seed)
        values = [{p.key: sample(p, rng) for p in self.space} for _ in range(self.s.population)]
        return {
            "settings": self.s.key(),
            "round": 0,
            "phase": "train",  # then "exploit", then the next round
            "members": [
                {"seed": self.s.seed + i, "values": values[i], "parent": None}
                for i in range(self.s.population)
            ],
            "rounds": [],  # per round: each member's values, score, env steps, parent
        }

    def _save_state(self, state: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(state, indent=1) + "\n")
        os.replace(tmp, self.state_path)

    # -- running -------------------------------------------------------------------------------
    def rounds(self) -> int:
        return math.ceil(self.s.steps / self.s.interval)

    def run(self) -> dict[str, Any]:
        """Train every round left; returns the state (``population.json``)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        lock = lock_run_dir(self.dir)
        previous = {s: signal.signal(s, self._on_signal) for s in stop_signals()}
        try:
            state = self._load_state()
            self._save_state(state)
            while state["round"] < self.rounds() and not self._stopping.is_set():
                r = state["round"]
                if state["phase"] == "train":  # every member to the round's end, scored
                    target = min((r + 1) * self.s.interval, self.s.steps)
                    scores = self._train_round(state, target)
                    if self._stopping.is_set():
                        break
                    members = [
                        {"values": m["values"], "score": scores[i], "parent": m["parent"]}
                        for i, m in enumerate(state["members"])
                    ]
                    state["rounds"].append({"round": r, "env_steps": target, "members": members})
                    state["phase"] = "exploit"
                    self._save_state(state)
                if self.s.exploit and r + 1 < self.rounds():
                    self._exploit(state, r)
                state["round"], state["phase"] = r + 1, "train"
                self._save_state(state)
            return state
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self._stop_runs()
            lock.close()

    def _train_round(self, state: dict[str, Any], target: int) -> list[float]:
        """Every member trained to ``target`` env steps (``jobs`` at a time); their scores."""
        members = list(range(self.s.population))
        with ThreadPoolExecutor(max_workers=self.s.jobs) as pool:
            return list(pool.map(lambda i: self._train_member(state, i, target), members))

    def _train_member(self, state: dict[str, Any], i: int, target: int) -> float:
        if self._stopping.is_set():
            return math.nan
        member = state["members"][i]
        run_dir = self.member_dir(i)
        values = overrides_of(member["values"])
        budget = [f"max_env_steps={target}"]
        summary_path = run_dir / "summary.json"
        if summary_path.is_file() and json.loads(summary_path.read_text())["env_steps"] >= target:
            return self._score(run_dir)  # this round was done before the tuner stopped
        if (run_dir / "checkpoints" / "last.pt").is_file():  # its own, or its parent's
            resumed = [*values, f"seed={member['seed']}", *budget]
            run = TrainingRun(run_dir, None, resumed, resume=True)
        else:
            overrides = [*self.s.overrides, *values, f"seed={member['seed']}", *budget]
            run = TrainingRun(run_dir, self.s.preset, overrides)
        with self._lock:
            self._runs.add(run)
        try:
            for _ in run.epochs():
                pass
            summary = run.wait()
        finally:
            with self._lock:
                self._runs.discard(run)
        if summary is None or summary.get("stopped_because") == "error":
            raise RuntimeError(
                f"member {i} failed: {(summary or {}).get('error') or run.failure()}"
            )
        return self._score(run_dir)

    def _score(self, run_dir: Path) -> float:
        """The objective's last value in the member's ``metrics.jsonl``."""
        path = run_dir / "metrics.jsonl"
        rows = (
            [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
        )
        values = [row[self.s.objective] for row in rows if finite(row.get(self.s.objective))]
        return float(values[-1]) if values else math.nan

    def _exploit(self, state: dict[str, Any], r: int) -> None:
        """The bottom quantile takes the top's checkpoints and perturbed values (seeded by the
        round, so a rerun after a crash does the same)."""
        scores = [m["score"] for m in state["rounds"][-1]["members"]]
        values = [m["values"] for m in state["members"]]
        rng = random.Random(f"{self.s.seed}-{r}")
        moves = exploit_and_explore(scores, values, self.space, self.s.quantile, rng)
        for member, parent, new in moves:
            copy_checkpoints(self.member_dir(parent), self.member_dir(member))
            state["members"][member] = {**state["members"][member], "values": new, "parent": parent}
            log.info(
                "round %d: member %d takes member %d's weights, values %s", r, member, parent, new
            )
        for i in set(range(self.s.population)) - {m for m, _, _ in moves}:
            state["members"][i]["parent"] = None

    def _on_signal(self, signum: int, _frame: Any) -> None:
        detach_output_on_hangup(signum)
        self._stopping.set()
        threading.Thread(target=self._stop_runs, daemon=True).start()

    def _stop_runs(self) -> None:
        with self._lock:
            runs = list(self._runs)
        for run in runs:
            run.stop()


def copy_checkpoints(source: Path, target: Path) -> None:
    """``target``'s checkpoints become ``source``'s (weights, optimizer state, counters), each
    file replaced atomically."""
    for name in ("last.pt", "best.pt"):
        src = source / "checkpoints" / name
        if not src.is_file():
            continue
        dst = target / "checkpoints" / name
        tmp = dst.with_suffix(".pt.copy")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
