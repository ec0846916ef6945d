"""benchmarks/dead_units.py counts, per ReLU layer, the units that output 0 on every frame."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

from dead_units import dead_fraction, dead_units, initial_policy  # noqa: E402


def test_a_unit_whose_preactivation_is_negative_on_every_observation_is_counted_dead():
    policy = initial_policy("cartpole", 0, ["model.activation=relu"])
    first = [m for m in policy.model.modules() if isinstance(m, torch.nn.Linear)][0]
    with torch.no_grad():  # every unit fires on every observation, but for units 3 and 7
        first.weight.zero_()
        first.bias.fill_(1.0)
        first.bias[[3, 7]] = -1.0
    layers = dead_units(policy, n_obs=32, seed=0)
    assert all(units > 0 for _, _, units in layers)
    _, dead, units = layers[0]
    assert (dead, units) == (2, first.out_features), layers
    with torch.no_grad():
        first.bias.fill_(1.0)
    revived = dead_units(policy, n_obs=32, seed=0)
    assert revived[0][1] == 0
    total = sum(u for _, _, u in revived)
    assert dead_fraction(policy, 32, 0) == sum(d for _, d, _ in revived) / total
