"""benchmarks/blackjack_exact.py: a policy's exact expected return is what Gymnasium's
Blackjack-v1 pays it on average over many hands."""

import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

from blackjack_exact import expected_return  # noqa: E402


def _dealer_rule(total: int, dealer: int, ace: bool) -> int:
    """Hit below 17, as the dealer plays (a policy with several states of each kind)."""
    return int(total < 17)


def _sampled(act, hands: int) -> tuple[float, float]:
    """The mean return of ``act`` over ``hands`` of the real env, and its standard error."""
    env = gym.make("Blackjack-v1")
    returns = np.empty(hands)
    obs, _ = env.reset(seed=0)
    for i in range(hands):
        total = 0.0
        done = False
        while not done:
            obs, reward, terminated, truncated, _ = env.step(act(obs[0], obs[1], bool(obs[2])))
            total += float(reward)
            done = terminated or truncated
        returns[i] = total
        obs, _ = env.reset()
    env.close()
    return float(returns.mean()), float(returns.std() / np.sqrt(hands))


@pytest.mark.parametrize("act", [lambda t, d, a: 0, _dealer_rule], ids=["stick", "dealer rule"])
def test_the_exact_return_is_the_envs_mean_over_many_hands(act):
    exact = expected_return(act)
    mean, se = _sampled(act, 40_000)
    assert abs(exact - mean) < 4 * se, (exact, mean, se)


def test_the_optimum_is_above_every_fixed_rule():
    optimum = expected_return(None)
    assert optimum == pytest.approx(-0.0466, abs=5e-4)
    for threshold in range(12, 21):
        assert expected_return(lambda t, d, a, k=threshold: int(t < k)) < optimum
