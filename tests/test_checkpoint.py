"""Checkpoints: atomic saves, safe loading, RNG state round trips."""

from __future__ import annotations

import os
import pickle
import random
import shlex
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from impala_rl import checkpoint
from impala_rl.checkpoint import CHECKPOINT_FORMAT, CheckpointError, load, save_atomic


def sample_checkpoint() -> dict:
    return {
        "format": CHECKPOINT_FORMAT,
        "model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.zeros(3)},
        "num_updates": 17,
        "config": {"algorithm": {"lr": 1e-3, "betas": [0.9, 0.999]}, "env": {"id": "CartPole-v1"}},
        "best_return": None,
        "name": "run",
    }


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b and type(a) is type(b)


def temp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_save_atomic_load_round_trip(tmp_path):
    path = tmp_path / "sub" / "dir" / "last.pt"  # parents are created
    obj = sample_checkpoint()
    save_atomic(obj, path)
    assert_same(load(path), obj)
    assert temp_files(path.parent) == []
    # overwriting replaces the content
    obj2 = {**obj, "num_updates": 18}
    save_atomic(obj2, path)
    assert load(path)["num_updates"] == 18


def test_missing_file_and_foreign_content_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load(tmp_path / "nope.pt")
    save_atomic({"model": torch.ones(1)}, tmp_path / "no_format.pt")
    with pytest.raises(CheckpointError, match="format"):
        load(tmp_path / "no_format.pt")
    save_atomic({"format": CHECKPOINT_FORMAT + 1}, tmp_path / "future.pt")
    with pytest.raises(CheckpointError, match="format"):
        load(tmp_path / "future.pt")
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(CheckpointError):
        load(tmp_path / "list.pt")


class _Exploit:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_crafted_pickle_is_refused_without_running_code(tmp_path, writer):
    marker = tmp_path / f"pwned_{uuid.uuid4().hex}"
    payload = {"format": CHECKPOINT_FORMAT, "model": _Exploit(marker)}
    path = tmp_path / "evil.pt"
    if writer == "torch.save":
        torch.save(payload, path)
    else:
        with open(path, "wb") as f:
            pickle.dump(payload, f)
    with pytest.raises(CheckpointError, match="cannot be loaded safely"):
        load(path)
    assert not marker.exists()

    # the payload is live: an unsafe load would have run the command
    if writer == "torch.save":
        torch.load(path, weights_only=False)
    else:
        with open(path, "rb") as f:
            pickle.load(f)
    assert marker.exists()


def _corruptions(raw: bytes) -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    out = {
        "truncated_half": raw[: len(raw) // 2],
        "truncated_tail": raw[:-10],
        "empty": b"",
        "text": b"hello world, not a checkpoint\n",
    }
    for i in range(4):
        out[f"random_{i}"] = rng.integers(0, 256, size=64 + 97 * i, dtype=np.uint8).tobytes()
    flipped = bytearray(raw)
    for i in range(len(flipped) // 4, len(flipped) // 4 + 64):
        flipped[i] ^= 0xFF
    out["bytes_flipped"] = bytes(flipped)
    return out


def test_corrupt_files_raise_checkpoint_error(tmp_path):
    good = tmp_path / "good.pt"
    save_atomic(sample_checkpoint(), good)
    raw = good.read_bytes()
    failures = {}
    for name, data in _corruptions(raw).items():
        path = tmp_path / f"{name}.pt"
        path.write_bytes(data)
        try:
            result = load(path)
        except CheckpointError:
            continue
        except Exception as exc:  # noqa: BLE001 - anything else is the bug being tested
            failures[name] = f"{type(exc).__name__}: {exc}"
        else:
            # a flip inside tensor data may still load; then it must still be a checkpoint
            if result.get("format") != CHECKPOINT_FORMAT:
                failures[name] = "loaded a non-checkpoint"
    assert failures == {}


class _Boom(RuntimeError):
    pass


@pytest.mark.parametrize("exc_type", [_Boom, KeyboardInterrupt])
def test_failed_save_keeps_the_previous_file_and_leaves_no_temp_files(
    tmp_path, monkeypatch, exc_type
):
    path = tmp_path / "last.pt"
    old = sample_checkpoint()
    save_atomic(old, path)
    old_bytes = path.read_bytes()
    real_save = torch.save

    def partial_save(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        f.truncate(len(old_bytes) // 3)  # half-written garbage on disk
        raise exc_type("disk full")

    monkeypatch.setattr(torch, "save", partial_save)
    with pytest.raises(exc_type):
        save_atomic({**old, "num_updates": 99}, path)
    monkeypatch.undo()

    assert path.read_bytes() == old_bytes
    assert_same(load(path), old)
    assert temp_files(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


def test_an_interruption_just_after_the_temp_file_is_created_removes_it(tmp_path, monkeypatch):
    """A second Ctrl-C can land between the file's creation and the code that holds its name;
    the name is known before the file exists, so it is removed all the same."""
    path = tmp_path / "last.pt"
    save_atomic(sample_checkpoint(), path)
    old_bytes = path.read_bytes()

    def created_then_interrupted(file, mode, *args, **kwargs):
        open(file, mode, *args, **kwargs).close()
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "open", created_then_interrupted, raising=False)
    with pytest.raises(KeyboardInterrupt):
        save_atomic({**sample_checkpoint(), "num_updates": 99}, path)
    monkeypatch.undo()
    assert path.read_bytes() == old_bytes
    assert temp_files(tmp_path) == []


def test_remove_temporaries_clears_a_killed_writes_files_and_nothing_else(tmp_path):
    save_atomic(sample_checkpoint(), tmp_path / "last.pt")
    (tmp_path / ".last.pt.123.abc.tmp").write_bytes(b"half")
    (tmp_path / "notes.tmp").write_text("the user's")
    assert checkpoint.remove_temporaries(tmp_path) == [".last.pt.123.abc.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", "notes.tmp"]
    assert checkpoint.remove_temporaries(tmp_path / "missing") == []


def _draw() -> tuple:
    return (
        [random.random() for _ in range(3)],
        random.gauss(0.0, 1.0),
        np.random.random(3).tolist(),
        float(np.random.standard_normal()),
        torch.rand(3).tolist(),
        torch.randn(2).tolist(),
    )


@pytest.fixture
def restore_global_rngs():
    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    yield
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    torch.set_rng_state(saved[2])


def test_rng_state_round_trip_restores_all_streams(tmp_path, restore_global_rngs):
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    # leave cached gaussians behind in python's and numpy's generators
    random.gauss(0.0, 1.0)
    np.random.standard_normal()
    state = checkpoint.rng_state()
    expected = _draw()

    _draw()  # move every stream on
    random.seed(999)
    np.random.seed(999)
    torch.manual_seed(999)
    assert _draw() != expected

    checkpoint.set_rng_state(state)
    assert _draw() == expected

    # and through a (weights_only) checkpoint file
    path = tmp_path / "rng.pt"
    save_atomic({"format": CHECKPOINT_FORMAT, "rng": state}, path)
    _draw()
    checkpoint.set_rng_state(load(path)["rng"])
    assert _draw() == expected
