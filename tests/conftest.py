"""The suite's order: the modules with the longest training runs first, so that with test
workers (``make test`` runs two with pytest-xdist) no long run is left to start last and end
the suite alone. The order within a module, and of the modules not named, stays."""

from __future__ import annotations

import pytest

from impala_rl.machine import set_omp_spin_count

# The learners of the tests' in-process runs wait as `impala train`'s do (set before torch is
# loaded): two test workers share the cores, where libgomp's long spin holds one the other needs.
set_omp_spin_count()

LONG_FIRST = (
    "test_families.py",  # LunarLander ~5 min, Pendulum ~2 min on 2 busy cores
    "test_learners.py",
    "test_tune.py",
    "test_pettingzoo.py",
    "test_step_minibatches.py",
    "test_appo.py",
    "test_minigrid.py",
    "test_trainer.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONG_FIRST.index(name) if name in LONG_FIRST else len(LONG_FIRST)

    items.sort(key=rank)
