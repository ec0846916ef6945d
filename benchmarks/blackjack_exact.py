"""The exact expected return per hand of Blackjack-v1 policies, free of the hands drawn.

A score over 10,000 hands has a standard error of ~0.01, the size of the gaps between good
policies. Gymnasium's ``Blackjack-v1`` (``natural=False``, ``sab=False``) draws from an
infinite deck and its dealer stands from 17 (a soft 17 too), so each policy's expected return
is a sum over the few hundred states it can meet. Printed: the optimal policy's (value
iteration), and the greedy final policy of every run of ``benchmarks/any_env.py --envs
blackjack`` in OUT, impala-rl's and SB3's, each computed the same way::

    python benchmarks/any_env.py --envs blackjack --seeds 0 1 2 --out runs/blackjack
    python benchmarks/blackjack_exact.py runs/blackjack
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import numpy as np

CARDS = {c: (4 / 13 if c == 10 else 1 / 13) for c in range(1, 11)}  # 10, J, Q, K: 4 of 13
BUST = 22

Act = Callable[[int, int, bool], int]  # (player's sum, dealer's card, usable ace) -> 0 stick, 1 hit


def _total(cards_sum: int, ace: bool) -> int:
    """A hand's sum, one ace counted as 11 where that does not bust it."""
    return cards_sum + 10 if ace and cards_sum + 10 <= 21 else cards_sum


@lru_cache(None)
def _dealer_final(cards_sum: int, ace: bool) -> tuple[tuple[int, float], ...]:
    """The dealer's final sums (``BUST`` for a bust) and their probabilities."""
    total = _total(cards_sum, ace)
    if total >= 17:
        return ((total if total <= 21 else BUST, 1.0),)
    out: dict[int, float] = {}
    for card, p in CARDS.items():
        for final, q in _dealer_final(cards_sum + card, ace or card == 1):
            out[final] = out.get(final, 0.0) + p * q
    return tuple(out.items())


@lru_cache(None)
def _stick(total: int, dealer_card: int) -> float:
    """The expected reward of sticking on ``total`` against the dealer's shown card."""
    value = 0.0
    for hidden, p in CARDS.items():
        for final, q in _dealer_final(dealer_card + hidden, dealer_card == 1 or hidden == 1):
            win = final == BUST or total > final
            value += p * q * (1.0 if win else 0.0 if total == final else -1.0)
    return value


def expected_return(act: Act | None) -> float:
    """The expected return per hand of ``act`` (``None``: the optimal policy)."""

    @lru_cache(None)
    def value(cards_sum: int, ace: bool, dealer_card: int) -> float:
        total = _total(cards_sum, ace)
        if total > 21:
            return -1.0
        usable = total != cards_sum  # an ace counted as 11

        def hit() -> float:
            return sum(
                p * value(cards_sum + c, ace or c == 1, dealer_card) for c, p in CARDS.items()
            )

        if act is None:
            return max(_stick(total, dealer_card), hit())
        return hit() if act(total, dealer_card, usable) == 1 else _stick(total, dealer_card)

    return sum(
        pa * pb * pd * value(a + b, a == 1 or b == 1, d)
        for a, pa in CARDS.items()
        for b, pb in CARDS.items()
        for d, pd in CARDS.items()
    )


def _impala_act(run_dir: Path) -> Act:
    from impala_rl import load_policy

    policy = load_policy(run_dir, which="last")  # the final policy, as any_env.py scores it
    return lambda total, dealer, ace: int(policy.act((total, dealer, int(ace)), deterministic=True))


def _sb3_act(model_zip: Path) -> Act:
    import gymnasium as gym
    from stable_baselines3 import PPO

    model = PPO.load(model_zip, device="cpu")
    space = gym.make("Blackjack-v1").observation_space
    return lambda total, dealer, ace: int(
        model.predict(gym.spaces.flatten(space, (total, dealer, int(ace))), deterministic=True)[0]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outs", type=Path, nargs="*", help="any_env.py OUTs with blackjack runs")
    args = parser.parse_args(argv)
    print(f"optimal policy: {expected_return(None):+.4f}")
    for lib, runs in (("impala-rl", "impala-seed*"), ("SB3", "sb3-seed*")):
        values = []
        for run in sorted(r for out in args.outs for r in (out / "blackjack").glob(runs)):
            act = _impala_act(run / "run") if lib == "impala-rl" else _sb3_act(run / "model.zip")
            values.append(expected_return(act))
            print(f"{lib} {run.name}: {values[-1]:+.4f}")
        if values:
            print(f"{lib}: median {np.median(values):+.4f} over {len(values)} runs")


if __name__ == "__main__":
    main()
