"""The PettingZoo AEC adapter and the tictactoe preset."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("pettingzoo.classic")

import impala_rl  # noqa: E402
from impala_rl.config import load_config  # noqa: E402
from impala_rl.envs import EnvFactory  # noqa: E402
from impala_rl.envs.factory import EnvError  # noqa: E402
from impala_rl.envs.pettingzoo import make_aec_env  # noqa: E402
from impala_rl.envs.structured import StructuredVectorEnv  # noqa: E402
from impala_rl.evaluation import evaluate  # noqa: E402
from impala_rl.learner import Learner  # noqa: E402
from impala_rl.nn.factory import build_model_for_env  # noqa: E402
from impala_rl.policy import load_policy  # noqa: E402
from impala_rl.rollout import ActorLoop, rollout_spec_for  # noqa: E402

FAST = ["log.console=false", "log.tensorboard=false"]
# A top row for player_1 (seat 0): 0, 3, 1, 4, 2
WINNING_GAME = [0, 3, 1, 4, 2]


def _win_rate(run_dir, n_games: int = 1000, seed: int = 12345) -> float:
    """The best checkpoint against random legal moves, on games the run never evaluated."""
    policy = load_policy(run_dir)
    env = policy.config.env
    factory = EnvFactory(env.id, {**env.kwargs, **env.eval_kwargs})
    result = evaluate(policy.model, factory, n_games, seed=seed)
    assert result.wins is not None and len(result.wins) == n_games
    return float(np.mean(result.wins))


def test_self_play_rewards_reach_both_players_and_agents_alternate():
    env = make_aec_env(opponent="self_play")
    assert env.n_agents == 2 and sorted(env.observation_spaces) == [0]
    obs, _ = env.reset(seed=0)
    assert obs["action_mask"].tolist() == [1] * 9
    seen = []
    for move in WINNING_GAME:
        seen.append(tuple(env.actor_id()))
        obs, reward, terminated, truncated, _ = env.step(move)
    assert seen == [(0, 0), (0, 1), (0, 0), (0, 1), (0, 0)]
    assert terminated and not truncated
    assert reward.tolist() == [1.0, -1.0]  # the loser, who did not move last, gets its -1


def test_per_agent_policies_use_the_seat_as_step_key():
    env = make_aec_env(opponent="self_play", policy_per_agent=True)
    env.reset(seed=0)
    assert sorted(env.action_spaces) == [0, 1]
    assert tuple(env.actor_id()) == (0, 0)
    env.step(4)
    assert tuple(env.actor_id()) == (1, 1)


def test_random_opponent_seat_follows_the_seed_and_reports_the_outcome():
    env = make_aec_env(opponent="random")
    assert env.n_agents == 1
    obs, _ = env.reset(seed=1)  # seat 1: the opponent has moved once
    assert int(obs["observation"][..., 1].sum()) == 1 and int(obs["observation"][..., 0].sum()) == 0
    obs, _ = env.reset(seed=2)  # seat 0: an empty board
    assert int(obs["observation"].sum()) == 0
    total, info, done = 0.0, {}, False
    while not done:
        legal = np.flatnonzero(obs["action_mask"])
        obs, reward, terminated, truncated, info = env.step(int(legal[0]))
        total += reward
        done = terminated or truncated
        assert tuple(env.actor_id()) == (0, 0)
    assert info["win"] == (total > 0)


def test_mixed_games_keep_the_seat_as_agent_id():
    env = make_aec_env(opponent="mixed", random_opponent_prob=1.0)
    assert env.n_agents == 2
    obs, _ = env.reset(seed=1)  # a random-opponent game, the learner in seat 1
    assert tuple(env.actor_id()) == (0, 1)
    total, done = np.zeros(2), False
    while not done:
        obs, reward, terminated, truncated, info = env.step(
            int(np.flatnonzero(obs["action_mask"])[0])
        )
        assert reward.shape == (2,)
        total += reward
        done = terminated or truncated
    assert info["win"] == (total[1] > 0)
    env = make_aec_env(opponent="mixed", random_opponent_prob=0.0)
    env.reset(seed=1)  # self-play: seat 0 moves first
    assert tuple(env.actor_id()) == (0, 0)


def test_unknown_opponent_and_missing_module_are_named():
    with pytest.raises(EnvError, match="opponent='chess'.*self_play \\| random \\| mixed"):
        make_aec_env(opponent="chess")
    with pytest.raises(EnvError, match="env.kwargs.env='pettingzoo.nope'"):
        make_aec_env(env="pettingzoo.nope")


def test_self_play_batch_trains_one_shared_policy_on_both_agents():
    cfg = load_config("tictactoe", ["env.kwargs.opponent=self_play"])
    factory = EnvFactory(cfg.env.id, cfg.env.kwargs)
    model = build_model_for_env(cfg.model, factory())
    assert model.step_keys == [0]  # one policy for both seats
    loop = ActorLoop(factory, 4, model, seed=0, unroll_length=20)
    slot = rollout_spec_for(model, None, 20, 4).allocate()  # type: ignore[arg-type]
    loop.unroll(slot)
    assert slot["reward"].shape == (20, 8)  # 4 envs x 2 seats: stretches of a seat's moves
    # the board from the mover's view ([3, 3, 2] flattened: own marks, then the opponent's):
    # the second player has one mark fewer than its opponent when it moves
    board = slot["obs"][0].reshape(8, 9, 2).sum(1)
    seat = (board[:, 1] - board[:, 0]).long()
    assert set(seat.tolist()) == {0, 1}
    # the sampled actions were legal
    mask = slot["action_mask"][:20]
    assert mask.gather(-1, slot["action"][:20].unsqueeze(-1)).all()
    # each seat's decisions alone move the one shared policy; with none it stays put
    params = model.policy_parameters(0)

    def policy_grad(seat_columns):
        cols = torch.as_tensor(seat_columns)
        batch = {k: (v[cols] if v.ndim == 1 else v[:, cols]).clone() for k, v in slot.items()}
        learner = Learner(copy.deepcopy(model), cfg.algorithm)
        learner.update(batch)
        moved = [
            (a - b).detach().abs().sum()
            for a, b in zip(learner.model.policy_parameters(0), params, strict=True)
        ]
        return float(sum(moved))

    first, second = (seat == 0).nonzero().flatten(), (seat == 1).nonzero().flatten()
    assert policy_grad(first) > 0 and policy_grad(second) > 0
    stats = Learner(copy.deepcopy(model), cfg.algorithm).update(slot)
    assert set(stats.policy_loss) == {0} and set(stats.critic_value_loss) == {0}


def test_vector_env_keeps_per_agent_rewards():
    venv = StructuredVectorEnv([lambda: make_aec_env(opponent="self_play")] * 2)
    venv.reset(seed=0)
    for move in WINNING_GAME:
        rewards, terminated, _, _, _ = venv.step([move, move])
    assert rewards.tolist() == [[1.0, -1.0], [1.0, -1.0]] and terminated.all()
    assert venv.step_key.tolist() == [0, 0]  # reset for the next game


def test_tictactoe_short_run_learns_against_random(tmp_path):
    """Budget 100k learner moves (~55 s alone on a 2-core AMD EPYC with AVX2; seed 0 wins 88%
    there, seeds 0-5 80-86% on a 2-core Intel Xeon): an untrained policy wins 36-42% of the
    same games."""
    impala_rl.train("tictactoe", [*FAST, "max_env_steps=100000"], run_dir=tmp_path)
    assert _win_rate(tmp_path) > 0.7


@pytest.mark.slow
def test_tictactoe_preset_beats_random_in_over_90_percent_of_games(tmp_path):
    """The preset's own budget (1M learner moves, 7-8 min on 2 cores, seed 0: 94.2%); the best
    checkpoint is then evaluated on 1000 fresh games, alternating seats."""
    summary = impala_rl.train("tictactoe", FAST, run_dir=tmp_path)
    assert summary["stopped_because"] == "max_env_steps"
    assert summary["env_steps"] <= 1_000_000 + 32 * 16
    assert _win_rate(tmp_path) > 0.9


def test_final_observation_is_the_seats_own_view_for_truncation_bootstraps():
    env = make_aec_env(opponent="self_play")
    env.reset(seed=0)
    env.step(4)  # seat 0 takes the centre
    for seat in (0, 1):
        key, obs = env.final_observation(seat)
        assert key == 0
        board = np.asarray(obs["observation"])
        own, other = board[..., 0].sum(), board[..., 1].sum()
        assert (own, other) == ((1, 0) if seat == 0 else (0, 1))  # observe(agent): its view


def test_load_policy_acts_per_step_key_with_legal_moves(tmp_path):
    impala_rl.train("tictactoe", [*FAST, "max_env_steps=2048"], run_dir=tmp_path)
    policy = load_policy(tmp_path, which="last")
    env = make_aec_env(opponent="random")
    for game in range(5):
        obs, _ = env.reset(seed=game)
        done = False
        while not done:
            key = env.actor_id().step_key
            move = policy.act(obs, step_key=key)
            assert obs["action_mask"][move] == 1
            assert move == policy.act(obs)  # one step key: it may be left out
            obs, _, terminated, truncated, _ = env.step(move)
            done = terminated or truncated
    with pytest.raises(ValueError, match=r"step_key=7 is not one of \[0\]"):
        policy.act(obs, step_key=7)


def test_a_cooperative_game_of_continuous_moves_steps_and_trains(tmp_path):
    """SISL's multiwalker: three walkers take turns (AEC), each move a Box of 4 torques. The
    adapter passes a continuous move as the array it is (it took every move as an int), a
    random opponent's too, and a short run trains on every walker's decisions."""
    pytest.importorskip("Box2D")
    env = make_aec_env("pettingzoo.sisl.multiwalker_v9")
    assert env.n_agents == 3 and env.action_space.shape == (4,)
    env.reset(seed=0)
    seen = []
    for _ in range(6):
        seen.append(env.actor_id().agent_id)
        _, reward, *_ = env.step(np.full(4, 0.5, np.float32))
        assert reward.shape == (3,)
    assert seen == [0, 1, 2, 0, 1, 2]
    versus = make_aec_env("pettingzoo.sisl.multiwalker_v9", opponent="random")
    versus.reset(seed=1)
    _, reward, *_ = versus.step(np.zeros(4, np.float32))  # then two random walkers move
    assert np.isfinite(reward)
    summary = impala_rl.train(
        "cartpole",
        [
            *FAST,
            "target_return=null",
            "env.id=impala_rl.envs.pettingzoo:make_aec_env",
            "env.kwargs.env=pettingzoo.sisl.multiwalker_v9",
            "max_env_steps=1500",
            "algorithm.rollout_evaluator.n_episodes=1",
        ],
        run_dir=tmp_path / "run",
    )
    assert summary["stopped_because"] == "max_env_steps", summary
    assert summary["env_steps"] >= 1500 and np.isfinite(summary["train_return_recent"] or 0.0)


class _MaskedMoves:
    """Two seats taking turns for 6 moves; each turn allows a random subset of moves (the
    ``action_mask``) and records every move it gets, so a test sees whether a move was legal."""

    def __init__(self, action_space):
        from gymnasium import spaces

        self.possible_agents = ["a", "b"]
        self._space = action_space
        width = (
            int(action_space.n)
            if isinstance(action_space, spaces.Discrete)
            else int(np.sum(action_space.nvec))
        )
        self._obs_space = spaces.Dict(
            {
                "observation": spaces.Box(0, 1, (2,), np.float32),
                "action_mask": spaces.MultiBinary(width),
            }
        )
        self._mask_rng = np.random.default_rng(0)
        self.moves: list[tuple[np.ndarray, object]] = []  # (the mask shown, the move taken)
        self.unwrapped = self

    def action_space(self, agent):
        return self._space

    def observation_space(self, agent):
        return self._obs_space

    def _new_mask(self):
        from gymnasium import spaces

        sizes = [self._space.n] if isinstance(self._space, spaces.Discrete) else self._space.nvec
        parts = []
        for n in sizes:
            part = (self._mask_rng.random(int(n)) < 0.5).astype(np.int8)
            part[self._mask_rng.integers(int(n))] = 1  # at least one value allowed
            parts.append(part)
        self._mask = np.concatenate(parts)

    def reset(self, seed=None, options=None):
        self.agents = list(self.possible_agents)
        self.agent_selection = "a"
        self.terminations = {a: False for a in self.agents}
        self.truncations = {a: False for a in self.agents}
        self.rewards = {a: 0.0 for a in self.agents}
        self._turn = 0
        self._new_mask()

    def observe(self, agent):
        return {"observation": np.zeros(2, np.float32), "action_mask": self._mask.copy()}

    def step(self, action):
        if self.terminations[self.agent_selection]:
            self.agents.remove(self.agent_selection)
            if self.agents:
                self.agent_selection = self.agents[0]
            return
        self.moves.append((self._mask.copy(), action))
        self._turn += 1
        self.rewards = {a: 0.0 for a in self.agents}
        if self._turn == 6:
            self.terminations = {a: True for a in self.agents}
        self.agent_selection = "b" if self.agent_selection == "a" else "a"
        self._new_mask()

    def close(self):
        pass


def _legal(space, mask, move) -> bool:
    from gymnasium import spaces

    if isinstance(space, spaces.Discrete):
        return isinstance(move, int) and bool(mask[move - space.start])
    values = np.asarray(move).reshape(-1) - np.asarray(space.start).reshape(-1)
    offsets = np.concatenate([[0], np.cumsum(space.nvec)[:-1]])
    return move in space and all(mask[o + v] for o, v in zip(offsets, values, strict=True))


@pytest.mark.parametrize(
    "space",
    [
        "Discrete(5, start=2)",
        "MultiDiscrete([3, 4, 2])",
        "MultiDiscrete([3, 4], start=[1, -2])",
    ],
)
def test_random_opponent_plays_only_legal_moves_of_any_masked_space(space):
    from gymnasium.spaces import Discrete, MultiDiscrete  # noqa: F401 (eval)

    from impala_rl.envs.pettingzoo import AECStructuredEnv

    aec = _MaskedMoves(eval(space))
    env = AECStructuredEnv(aec, opponent="random")
    learner_moves: set[int] = set()
    for episode in range(20):
        env.reset(seed=episode)
        done = False
        while not done:
            learner_moves.add(len(aec.moves))
            mask = aec.observe("a")["action_mask"]
            move = random_legal_move_for_test(aec.action_space("a"), mask)
            _, _, terminated, truncated, _ = env.step(move)
            done = terminated or truncated
    opponent = [move for i, move in enumerate(aec.moves) if i not in learner_moves]
    assert len(opponent) == 60  # 3 of each game's 6 moves
    illegal = [(m, a) for m, a in opponent if not _legal(aec.action_space("a"), m, a)]
    assert not illegal, illegal[:3]


def random_legal_move_for_test(space, mask):
    from impala_rl.envs.pettingzoo import random_legal_move

    return random_legal_move(space, mask, np.random.default_rng(7))


def test_random_opponent_replays_a_seeded_game_of_unmasked_moves():
    from gymnasium import spaces

    from impala_rl.envs.pettingzoo import random_legal_move

    box = spaces.Box(-1, 1, (3,), np.float32)
    draws = [
        [random_legal_move(box, None, rng) for _ in range(4)]
        for rng in (np.random.default_rng(3), np.random.default_rng(3))
    ]
    np.testing.assert_array_equal(np.stack(draws[0]), np.stack(draws[1]))
    assert all(box.contains(move) for move in draws[0])


def test_a_random_opponent_keeps_a_dict_action_to_its_masked_parts():
    """A Dict action's mask (flat, or keyed as its masked parts) holds each masked part to its
    legal values; the amount between them is drawn as its space's, and a mask missing a part
    is named."""
    from gymnasium import spaces

    from impala_rl.envs.pettingzoo import random_legal_move

    space = spaces.Dict(
        {
            "amount": spaces.Box(-1.0, 1.0, (1,), np.float32),
            "choice": spaces.Discrete(4, start=1),
            "slot": spaces.MultiDiscrete([2, 3]),
        }
    )
    choice, slot = np.array([0, 1, 0, 1]), np.array([1, 0, 0, 0, 1])
    for mask in (np.concatenate([choice, slot]), {"choice": choice, "slot": slot}):
        rng = np.random.default_rng(5)
        moves = [random_legal_move(space, mask, rng) for _ in range(200)]
        assert all(space.contains(m) for m in moves)
        assert {m["choice"] for m in moves} == {2, 4}  # start 1: the mask's entries 1 and 3
        assert {tuple(m["slot"].tolist()) for m in moves} == {(0, 2)}
        assert np.std([m["amount"][0] for m in moves]) > 0.1
    with pytest.raises(EnvError, match="no part 'slot'"):
        random_legal_move(space, {"choice": choice}, np.random.default_rng(0))
    pair = spaces.Tuple((spaces.Discrete(3), spaces.Discrete(2)))
    for mask in ([0, 0, 1, 1, 0], ([0, 0, 1], [1, 0])):  # one flat list, or a list per part
        assert random_legal_move(pair, mask, np.random.default_rng(1)) == (2, 0)


def test_a_random_opponent_keeps_each_bit_of_a_multibinary_move_to_its_mask():
    """Two mask entries per bit (may it be 0, may it be 1): a bit with one legal value always
    takes it, a free bit takes both; flat, as per-bit pairs, or inside a Dict action alike."""
    from gymnasium import spaces

    from impala_rl.envs.pettingzoo import random_legal_move

    space = spaces.MultiBinary(3)
    pairs = [[1, 0], [1, 1], [0, 1]]  # bit 0 must be 0, bit 1 is free, bit 2 must be 1
    for mask in (np.array(pairs).reshape(-1), pairs):
        rng = np.random.default_rng(2)
        moves = np.stack([random_legal_move(space, mask, rng) for _ in range(100)])
        assert moves.dtype == space.dtype and all(space.contains(m) for m in moves)
        assert set(moves[:, 0]) == {0} and set(moves[:, 1]) == {0, 1} and set(moves[:, 2]) == {1}
    switches = spaces.Dict({"choice": spaces.Discrete(2), "lights": space})
    mask = {"choice": np.array([0, 1]), "lights": np.array(pairs).reshape(-1)}
    moves = [random_legal_move(switches, mask, np.random.default_rng(s)) for s in range(50)]
    assert {m["choice"] for m in moves} == {1}
    assert {(m["lights"][0], m["lights"][2]) for m in moves} == {(0, 1)}
    with pytest.raises(EnvError, match="allows no value"):
        random_legal_move(space, [1, 0, 0, 0, 0, 1], np.random.default_rng(0))


def test_a_pettingzoo_module_as_env_id_is_played_through_the_aec_adapter():
    """``env.id=pettingzoo.classic.tictactoe_v3``: the module's game as ``make_aec_env`` plays
    it, ``env.kwargs`` its other arguments; the game given twice, or an argument it does not
    take, is refused by name."""
    env = EnvFactory("pettingzoo.classic.tictactoe_v3", {"opponent": "random"})()
    try:
        assert env.n_agents == 1 and env.action_space.n == 9
        obs, _ = env.reset(seed=2)
        assert int(obs["observation"].sum()) == 0  # seat 0: an empty board, as make_aec_env's
    finally:
        env.close()
    with pytest.raises(EnvError, match="give the game once"):
        EnvFactory("pettingzoo.classic.tictactoe_v3", {"env": "pettingzoo.classic.go_v5"})()
    with pytest.raises(EnvError, match="env.kwargs for .*valid: env_kwargs, opponent"):
        EnvFactory("pettingzoo.classic.tictactoe_v3", {"oponent": "random"})()
    with pytest.raises(EnvError, match="cannot import"):
        EnvFactory("pettingzoo.classic.no_such_game_v1")()


def test_a_board_game_id_trains_against_both_opponents_and_evaluates_a_win_rate(caplog):
    from impala_rl.env_defaults import resolve_config

    with caplog.at_level("INFO", logger="impala_rl.env_defaults"):
        cfg = resolve_config(None, ["env.id=pettingzoo.classic.tictactoe_v3"])
    assert cfg.env.kwargs["opponent"] == "mixed"
    assert cfg.env.eval_kwargs["opponent"] == "random"
    assert cfg.algorithm.rollout_evaluator.n_episodes == 200  # a win rate to choose on
    assert "trained against itself and random legal moves" in caplog.text
    given = resolve_config(
        None, ["env.id=pettingzoo.classic.tictactoe_v3", "env.kwargs.opponent=self_play"]
    )
    assert given.env.kwargs["opponent"] == "self_play"
    assert given.env.eval_kwargs["opponent"] == "random"
    pytest.importorskip("Box2D")
    cooperative = resolve_config(None, ["env.id=pettingzoo.sisl.multiwalker_v9"])
    assert "opponent" not in cooperative.env.kwargs  # all walkers learn: no opponent to pick
    assert "opponent" not in cooperative.env.eval_kwargs


def test_tictactoe_typed_as_its_module_learns_to_beat_random_moves(tmp_path):
    """``impala train env.id=pettingzoo.classic.tictactoe_v3`` with no preset (any_env's
    settings, mixed opponents): 100k learner moves (~50-70 s on 2 cores; seed 0 wins 93.5% of
    1000 fresh games, seeds 0-5 90-93% on a 2-core Intel Xeon), where an untrained policy wins
    36-42%."""
    impala_rl.train(
        None,
        [*FAST, "env.id=pettingzoo.classic.tictactoe_v3", "max_env_steps=100000"],
        run_dir=tmp_path,
    )
    assert _win_rate(tmp_path) > 0.75


def test_a_game_that_cannot_be_imported_says_why_where_it_was_given(tmp_path, monkeypatch):
    """The field the user typed (env.id, or env.kwargs.env) and the cause: no such game module,
    or a game's own package missing (PettingZoo's extra for its family)."""
    import pettingzoo.classic

    from impala_rl.envs.pettingzoo import _import_aec

    with pytest.raises(EnvError, match=r"env.id='pettingzoo.classic.no_such_v1'.*no such module"):
        EnvFactory("pettingzoo.classic.no_such_v1")()
    with pytest.raises(EnvError, match=r"env.kwargs.env='pettingzoo.classic.no_such_v1'"):
        make_aec_env("pettingzoo.classic.no_such_v1")
    # a classic game whose own package is missing, as chess without python-chess
    (tmp_path / "impala_needs_v1.py").write_text("import impala_missing_board_lib\n")
    monkeypatch.setattr(
        pettingzoo.classic, "__path__", [*pettingzoo.classic.__path__, str(tmp_path)]
    )
    with pytest.raises(EnvError, match=r"the game needs impala_missing_board_lib: .*\[classic\]"):
        _import_aec("pettingzoo.classic.impala_needs_v1", {}, "env.id")
    # one that imports its package only when built, as Hanabi does OpenSpiel
    (tmp_path / "impala_builds_v1.py").write_text(
        "def env(**kwargs):\n    raise ImportError('needs OpenSpiel: pip install open_spiel')\n"
    )
    with pytest.raises(EnvError, match=r"env.id='pettingzoo.classic.impala_builds_v1': needs Open"):
        EnvFactory("pettingzoo.classic.impala_builds_v1")()


class _FoldFirst(_MaskedMoves):
    """The first move may end the game (0: fold, as in poker); ``fold_only``: it must."""

    def __init__(self, fold_only: bool = False):
        from gymnasium import spaces

        super().__init__(spaces.Discrete(2))
        self.fold_only = fold_only

    def _new_mask(self):
        self._mask = np.array([1, 0 if self.fold_only and self._turn == 0 else 1], np.int8)

    def reset(self, seed=None, options=None):
        self._turn = 0
        super().reset(seed, options)

    def step(self, action):
        if self._turn == 0 and action == 0 and not self.terminations[self.agent_selection]:
            self.moves.append((self._mask.copy(), action))
            self.terminations = {a: True for a in self.agents}
            self.rewards = {a: 0.0 for a in self.agents}
            self._mask = np.zeros(2, np.int8)
            return
        super().step(action)


def test_a_game_the_opponent_ends_before_the_learner_moves_is_dealt_again():
    """Poker's first player may fold: against random opponents a reset that ends the game
    before the learning seat's first move deals again, so every episode starts with a legal
    decision (the learner stepping a finished game was the env's ValueError)."""
    from impala_rl.envs.pettingzoo import AECStructuredEnv

    env = AECStructuredEnv(_FoldFirst(), opponent="random")
    second_seat = 0
    for episode in range(40):
        obs, _ = env.reset(seed=episode)
        assert obs["action_mask"].any() and not env._over()
        second_seat += env._learner_seat == 1
        env.step(1)  # a legal move (play on): the env accepts it
    assert second_seat >= 10  # the opponent moved first in these, folding in about half
    with pytest.raises(EnvError, match="ended 100 games in a row"):
        always = AECStructuredEnv(_FoldFirst(fold_only=True), opponent="random")
        always.reset(seed=1)  # seat 1: the opponent's only first move is a fold
