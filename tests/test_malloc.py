"""The learner process's malloc settings: large freed blocks stay in the process."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="mallopt settings exist on glibc only"
)

# Page faults per "update" that allocates 100 blocks of 1 MB (25,600 pages), writes them and
# frees them all, as a learner's activations are: glibc returns part of them to the OS by
# default, so the next update faults those pages in again.
PROBE = """
import resource, sys, torch
from impala_rl.malloc import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def update():
    blocks = [torch.ones(1 << 18) for _ in range(100)]
    del blocks
for _ in range(3):
    update()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    update()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
"""
PAGES_PER_UPDATE = 100 * (1 << 20) // 4096


def faults_per_update(mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip())


def test_keep_freed_memory_keeps_freed_blocks_in_the_process():
    kept = faults_per_update("keep")
    assert kept < PAGES_PER_UPDATE / 100
    # How much glibc trims by default varies with the address layout (seen: 0.6k-25k faults
    # per update), now and then nothing: the most of three runs.
    default = max(faults_per_update("default") for _ in range(3))
    assert kept < default


def test_the_trainer_applies_it_unless_switched_off(monkeypatch, tmp_path):
    import impala_rl
    import impala_rl.startup as startup

    calls = []
    monkeypatch.setattr(startup, "keep_freed_memory", lambda: calls.append(1) or True)
    common = ["max_env_steps=640", "runner.backend=sequential", "log.console=false"]
    impala_rl.train("cartpole", common, run_dir=tmp_path / "a")
    assert calls == [1]
    impala_rl.train("cartpole", [*common, "runner.keep_freed_memory=false"], run_dir=tmp_path / "b")
    assert calls == [1]
