"""What the README promises, a new user gets: the review's findings, each with a test that
failed before its fix, and every numeric config key refused by name when out of range."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest

import impala_rl
from impala_rl.cli import main
from impala_rl.config import RULES, RunConfig, load_config
from impala_rl.writers import plain_epoch_line

FAST = [
    "log.console=false",
    "log.tensorboard=false",
    "runner.backend=sequential",
    "target_return=null",
    "algorithm.rollout_evaluator.background=false",
    "max_env_steps=256",
    "algorithm.epoch_length=2",
]


def _numeric_keys(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, type]]:
    """Every key of the schema that holds a number (int or float, nullable or not)."""
    keys = []
    instance = cls()
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            keys += _numeric_keys(type(value), f"{prefix}{f.name}.")
        elif any(t in str(f.type) for t in ("int", "float")) and "list" not in str(f.type):
            if "dict" in str(f.type) or "bool" == str(f.type):
                continue
            keys.append((f"{prefix}{f.name}", float if "float" in str(f.type) else int))
    return keys


NUMERIC = _numeric_keys()
BAD = {int: ["-1", "-1000000", "0", "4294967296"], float: ["nan", "-inf", "inf", "-1", "0"]}


def test_every_numeric_key_has_a_rule():
    missing = [key for key, _ in NUMERIC if key not in RULES]
    assert not missing, f"numeric config keys without a range in config.RULES: {missing}"


@pytest.mark.parametrize(("key", "kind"), NUMERIC, ids=[k for k, _ in NUMERIC])
def test_a_bad_value_of_every_numeric_key_is_refused_by_name(key, kind, capsys, tmp_path):
    """Some value of the key's own type is out of its range; the CLI refuses it before
    anything starts, with one ``impala: error:`` line naming the key and no traceback."""
    for bad in BAD[kind]:  # the first value out of the key's range
        capsys.readouterr()
        run = tmp_path / "run"
        args = [
            "train",
            "cartpole",
            *FAST,
            "max_env_steps=1",
            f"{key}={bad}",
            "--run-dir",
            str(run),
        ]
        code = main(args)
        out = capsys.readouterr()
        if code == 0:  # in range: a one-batch run
            shutil.rmtree(run, ignore_errors=True)
            continue
        assert code == 2, (key, bad, code)
        assert f"impala: error: invalid value for '{key}'" in out.err, (key, bad, out.err)
        assert "Traceback" not in out.err + out.out
        assert not run.exists()  # refused before anything started
        return
    pytest.fail(f"{key}: none of {BAD[kind]} is out of its range")


def test_a_negative_seed_is_refused_by_name(capsys, tmp_path):
    code = main(["train", "cartpole", "seed=-1", "--run-dir", str(tmp_path / "run")])
    assert code == 2 and "'seed'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # before: a run with "stopped_because": "error"


@pytest.mark.parametrize(
    "override",
    [
        "model.hidden_sizes=[32]",
        "env.id=Acrobot-v1",
        "model.activation=relu",
        "env.max_image_side=64",
        "env.float_images=false",
    ],
)
def test_resume_refuses_an_override_the_saved_weights_cannot_follow(override, tmp_path, capsys):
    impala_rl.train("cartpole", FAST, run_dir=tmp_path)
    capsys.readouterr()
    code = main(["train", "--resume", str(tmp_path), override])
    err = capsys.readouterr().err
    key = override.split("=")[0]
    assert code == 2 and f"{key}=" in err and "on resume" in err, err  # before: RuntimeError
    assert "Traceback" not in err


def test_resume_takes_overrides_that_fit_the_saved_weights(tmp_path):
    impala_rl.train("cartpole", FAST, run_dir=tmp_path)
    summary = impala_rl.train(
        run_dir=tmp_path, resume=True, overrides=["max_env_steps=512", "algorithm.lr=1e-3"]
    )
    assert summary["env_steps"] >= 512


def test_a_run_that_ends_in_error_prints_its_summary_and_says_it_failed(tmp_path, capsys):
    """The summary a script reads is on stdout with ``"stopped_because": "error"``; the exit
    status is 1 (2 is for a command refused before anything ran)."""
    overrides = [*FAST, "env.id=nan_env:make_nan_env", "max_env_steps=2000"]
    code = main(["train", "cartpole", *overrides, "--run-dir", str(tmp_path / "run")])
    out = capsys.readouterr()
    assert code == 1, out.err
    summary = json.loads(out.out)
    assert summary["stopped_because"] == "error" and "error" in summary
    assert "impala: error:" in out.err
    with pytest.raises(Exception) as raised:  # the Python API: the error carries the summary
        impala_rl.train("cartpole", overrides, run_dir=tmp_path / "api")
    assert raised.value.summary["stopped_because"] == "error"


def test_the_plain_epoch_line_is_at_full_precision():
    value = 0.1 + 0.2  # 0.30000000000000004: 6 digits would read back as 0.3
    line = plain_epoch_line(3, 100, {"loss": value, "lr": 3e-4})
    written = dict(word.split("=") for word in line.split())
    assert float(written["loss"]) == value and float(written["lr"]) == 3e-4
    assert math.isnan(float(plain_epoch_line(1, 1, {"x": math.nan}).split("x=")[1]))


def test_eval_makes_the_video_folder(tmp_path, capsys):
    pytest.importorskip("moviepy")
    impala_rl.train("cartpole", FAST, run_dir=tmp_path / "run")
    video = tmp_path / "missing" / "dir" / "ep.mp4"
    code = main(["eval", str(tmp_path / "run"), "--episodes", "1", "--video", str(video)])
    assert code == 0, capsys.readouterr().err  # before: FileNotFoundError traceback
    assert video.is_file() and video.stat().st_size > 0


def test_the_device_reference_lists_every_device_the_rules_take():
    from pathlib import Path

    reference = (Path(__file__).resolve().parents[1] / "docs" / "reference.md").read_text()
    row = next(line for line in reference.splitlines() if line.startswith("| `algorithm.device`"))
    for device in ("cpu", "cuda", "cuda:N", "mps", "auto"):
        assert f"``{device}``" in row, device
    for device in ("cpu", "cuda", "cuda:1", "mps", "auto"):
        assert load_config(overrides=[f"algorithm.device={device}"]).algorithm.device == device


# -- the docs' own claims (findings 1, 6, 7 and 9) ------------------------------------------------

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
USER_DOCS = ["README.md", "docs/usage.md"]


def test_every_train_log_the_docs_show_catches_the_log():
    """Finding 1: the log goes to stderr, so a ``> train.log`` that leaves stderr on the terminal
    keeps only the summary; every ``train.log`` the docs name redirects stderr."""
    import re

    shown = []
    for name in USER_DOCS:
        for match in re.finditer(r"`([^`]*train\.log[^`]*)`", (ROOT / name).read_text()):
            shown.append((name, match.group(1)))
    assert shown
    for name, text in shown:
        assert "2>" in text, f"{name}: `{text}` leaves the log on the terminal"


def test_the_readme_gets_torch_from_its_cpu_index():
    """Finding 6: on the public index a pinned version alone gives Linux a CUDA build; the
    README's torch line names PyTorch's CPU index."""
    lines = [
        line
        for line in (ROOT / "README.md").read_text().splitlines()
        if line.startswith("pip install torch")
    ]
    assert lines
    for line in lines:
        assert "--index-url https://download.pytorch.org/whl/cpu" in line, line


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_train_installs_the_package_alone_not_the_dev_set():
    """Finding 7: what ``make train`` would run from scratch (``make -n -B``) installs torch and
    the package, not the ``dev`` extra (Ray, envpool, MuJoCo, pytest, ...)."""
    import subprocess

    out = subprocess.run(
        ["make", "-n", "-B", "train"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "pip install -q -e ." in out
    assert "[dev]" not in out
    assert "impala train cartpole" in out


def test_models_doc_reports_appo_on_pong_as_measured():
    """Finding 9: docs/models.md said APPO on Pong was not measured while the ``pong_appo``
    preset and the README report it."""
    text = (ROOT / "docs" / "models.md").read_text()
    appo = text[text.index("`algorithm.policy_loss=appo`") :][:1500]
    assert "not measured" not in appo
    assert "pong_appo" in appo and "+18" in appo
