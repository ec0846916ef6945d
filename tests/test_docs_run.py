"""Every command and Python block of the README and docs/ runs (results and experiments pages
record runs, they are not instructions).

A block runs as written with a small budget: each ``impala train`` line with one short epoch
(``max_env_steps``, ``algorithm.epoch_length``, a one-episode evaluation), each ``impala
eval`` on the run before it with two episodes, a Python block as a script in an empty folder.
A block that cannot run in CI says why in a comment above it,
``<!-- docs: not run: needs a GPU -->`` (the reasons in :data:`NOT_RUN`); a synopsis
(``<!-- docs: synopsis -->``) is checked against ``--help``; a sample of the console output
(``<!-- docs: output -->``) against a real run's.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_DOCS = {"results.md", "reference.md"}  # records of runs, generated tables
NOT_RUN = {
    "needs a GPU",
    "needs several GPUs",
    "needs a Ray cluster",
    "needs Kubernetes",
    "installs packages",
    "the set-up and the suite themselves",
    "a diagram",
    "trains for hours",
    "a notebook's cells",  # a script would re-run them in its processes: test_session_env
}
MARK = re.compile(r"<!-- docs: (not run: (?P<reason>[^>]+?)|synopsis|output|study file) -->\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")
BUDGET = [
    "max_env_steps=1",
    "algorithm.epoch_length=1",
    "algorithm.rollout_evaluator.n_episodes=1",
    "algorithm.rollout_evaluator.max_episode_steps=50",
    "log.console=false",
    "log.tensorboard=false",
]


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    text: str
    mark: str | None  # "synopsis", "output", "not run: reason" or None

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks() -> list[Block]:
    blocks = []
    for page in PAGES:
        if page.name in NOT_DOCS:
            continue
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = FENCE.match(lines[i])
            if not fence:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            above = lines[i - 1] if i and lines[i - 1].strip() else lines[i - 2] if i > 1 else ""
            match = MARK.search(above)
            mark = None if match is None else match.group(1)
            rel = page.relative_to(ROOT).as_posix()
            blocks.append(Block(rel, i + 1, fence.group(1), "\n".join(lines[i + 1 : end]), mark))
            i = end + 1
    return blocks


BLOCKS = _blocks()


def _env() -> dict[str, str]:
    paths = [str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def test_every_block_runs_or_says_why_not():
    unmarked = [b.name for b in BLOCKS if b.mark is None and b.lang not in ("bash", "python")]
    assert not unmarked, f"blocks neither runnable nor marked: {unmarked}"
    reasons = {b.mark.split(": ", 1)[1] for b in BLOCKS if b.mark and b.mark.startswith("not")}
    assert reasons <= NOT_RUN, reasons - NOT_RUN
    assert sum(b.mark is None for b in BLOCKS) >= 8  # the runnable ones: see below


def _commands(text: str) -> list[list[str]]:
    """The command lines of a shell block (``\\`` continuations joined, comments dropped)."""
    text = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            out.append(shlex.split(line))
    return out


def _runnable() -> list[Block]:
    """The unmarked blocks, each text once (the README and a page may show the same one)."""
    seen: set[str] = set()
    out = []
    for block in BLOCKS:
        if block.mark is None and block.text not in seen:
            seen.add(block.text)
            out.append(block)
    return out


RUNNABLE = _runnable()


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.name for b in RUNNABLE])
def test_a_documented_block_runs(block: Block, tmp_path):
    if block.lang == "python":
        script = tmp_path / "example.py"
        script.write_text(block.text)
        proc = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return
    last_run: Path | None = None
    for n, words in enumerate(_commands(block.text)):
        assert words[0] == "impala", f"{block.name}: only impala commands run here: {words}"
        if words[1] == "train":
            last_run = tmp_path / f"run{n}"
            args = [*words[2:], *BUDGET, "--run-dir", str(last_run)]
        elif words[1] == "tune":  # one short trial (or round of two members)
            args = _tune_budget(words[2:], tmp_path / f"study{n}")
        else:  # eval or plot: the run before it
            assert last_run is not None, f"{block.name}: {words[1]} before any train"
            args = [
                last_run.as_posix() if "<" in w or w.startswith("runs/") else w for w in words[2:]
            ]
            if "--episodes" in args:
                args[args.index("--episodes") + 1] = "2"
        proc = subprocess.run(
            [sys.executable, "-m", "impala_rl.cli", words[1], *args],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, f"{' '.join(words)}:\n{proc.stderr[-3000:]}"
        if words[1] == "train":
            summary = json.loads(proc.stdout)
            assert summary["stopped_because"] in ("max_env_steps", "target_return")
        if words[1] == "tune":
            assert json.loads(proc.stdout)["study_dir"] == str(tmp_path / f"study{n}")


TUNE_BUDGET = {"--trials": "1", "--steps": "640", "--jobs": "1", "--population": "2"}


def _tune_budget(args: list[str], study_dir: Path) -> list[str]:
    """``impala tune``'s arguments with one short trial (a population of two, one round)."""
    out, skip = [], False
    for word in args:
        if skip:
            skip = False
            continue
        name = word.split("=", 1)[0]
        if name in (*TUNE_BUDGET, "--interval", "--study-dir"):
            skip = "=" not in word
            continue
        out.append(word)
    budget = [x for k, v in TUNE_BUDGET.items() for x in (k, v)]
    if "--pbt" in out:
        budget += ["--interval", "640"]
    budget += ["--study-dir", str(study_dir), "log.tensorboard=false", *BUDGET[2:4]]
    return [*out, *budget]  # --steps sets each trial's max_env_steps, after these


SYNOPSES = [b for b in BLOCKS if b.mark == "synopsis"]


@pytest.mark.parametrize("block", SYNOPSES, ids=[b.name for b in SYNOPSES])
def test_a_synopsis_names_the_commands_options(block: Block):
    for words in _commands(block.text):
        help_text = subprocess.run(
            [sys.executable, "-m", "impala_rl.cli", words[1], "--help"],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
        for option in re.findall(r"--[a-z-]+", " ".join(words)):
            assert option in help_text, f"{block.name}: {option} is not an option of {words[1]}"


@pytest.fixture(scope="module")
def real_cartpole_output(tmp_path_factory) -> tuple[str, dict]:
    """A real cartpole run's plain epoch line (its log is not a terminal) and summary."""
    run = tmp_path_factory.mktemp("cartpole") / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "impala_rl.cli", "train", "cartpole", "--run-dir", str(run)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("epoch=")]
    return lines[-1], json.loads(proc.stdout)


SAMPLE_LINE = re.compile(r"`(epoch=\d+ env_steps=\d+ [^`]*)`")


def test_the_documented_plain_line_is_a_real_one(real_cartpole_output):
    real, _ = real_cartpole_output
    real_keys = [word.split("=", 1)[0] for word in real.split()]
    samples = [m for page in PAGES for m in SAMPLE_LINE.findall(page.read_text())]
    assert samples
    for sample in samples:
        words = [w for w in sample.split() if w != "..."]
        keys = [w.split("=", 1)[0] for w in words]
        assert keys[:3] == real_keys[:3], sample  # it starts as real lines do
        assert keys[-1] == real_keys[-1], (
            f"{sample} ends with {keys[-1]}, real lines with {real_keys[-1]}"
        )
        for word in words:  # full precision: every number reads back as written
            value = word.split("=", 1)[1]
            assert float(value) == float(repr(float(value)))


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.mark == "output"], ids=lambda b: b.name)
def test_a_documented_summary_has_the_real_keys(block: Block, real_cartpole_output):
    _, summary = real_cartpole_output
    documented = set(re.findall(r'"(\w+)":', block.text))
    assert documented and documented <= set(summary), documented - set(summary)


STUDY_FILES = [b for b in BLOCKS if b.mark == "study file"]


@pytest.mark.parametrize("block", STUDY_FILES, ids=[b.name for b in STUDY_FILES])
def test_a_documented_study_file_is_a_valid_study(block: Block, tmp_path):
    pytest.importorskip("optuna")
    from impala_rl.tune.cli import study_file_settings
    from impala_rl.tune.space import parse_space

    path = tmp_path / "study.yaml"
    path.write_text(block.text)
    config, section = study_file_settings(str(path), tmp_path / "study")
    space = [f"{k}={v}" for k, v in section["space"].items()]
    assert parse_space(space, config, [])
