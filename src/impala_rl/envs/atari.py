"""Atari through ale-py (which ships the ROMs) with the standard DQN/IMPALA preprocessing.

Use it as ``env.id=impala_rl.envs.atari:make_atari_env`` with ``env.kwargs.game=ALE/Pong-v5``.
Observations are ``uint8 [frame_stack, 84, 84]`` and stay ``uint8`` up to the network; with
``env.kwargs.obs_type=ram`` (or gym's RAM ids, ``ALE/Pong-ram-v5``, ``Pong-ramNoFrameskip-v4``,
which ale-py no longer registers) the console's 128 bytes of RAM, ``frame_stack`` of them in one
``uint8 [frame_stack * 128]`` vector.

``env.kwargs.vector`` picks how an actor steps its envs: ``python`` (Gymnasium's wrappers, one
env after the other) or ``ale`` (ale-py's C++ vector env with the same preprocessing and
same-step autoreset, ``env.kwargs.vector_threads`` threads per actor; ~20% cheaper per step on
one thread).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import gymnasium as gym

from impala_rl.envs.spaces import EnvError

VECTOR_BACKENDS = ("python", "ale")
OBS_TYPES = ("rgb", "ram")
RAM_ID = re.compile(r"(?P<ns>ALE/)?(?P<name>[A-Z][A-Za-z]*?)-ram(?P<rest>(NoFrameskip)?-v\d+)")
"""Gym's ids of an ALE game's RAM observations (``ALE/Pong-ram-v5``, ``Pong-ram-v4``,
``Pong-ramNoFrameskip-v4``): ale-py >= 0.9 registers none of them, only ``obs_type="ram"`` on
the game's own id."""


def split_ram_id(env_id: str) -> tuple[str, bool]:
    """``(game id, whether env_id names its RAM)``: ``ALE/Pong-ram-v5`` -> ``("ALE/Pong-v5",
    True)``, ``Pong-ramNoFrameskip-v4`` -> ``("PongNoFrameskip-v4", True)``; any other id as
    it is, with False."""
    match = RAM_ID.fullmatch(env_id)
    if match is None:
        return env_id, False
    return f"{match['ns'] or ''}{match['name']}{match['rest']}", True


@dataclasses.dataclass(frozen=True)
class AtariSettings:
    """``env.kwargs`` of :func:`make_atari_env` and :func:`make_atari_vector_env`: an ALE game
    with noop resets, frame skip with max-pooling over the last two frames, grayscale
    ``screen_size`` x ``screen_size`` frames, a stack of ``frame_stack`` frames, optional
    episodic life, and v5's sticky actions (``repeat_action_probability``)."""

    game: str = "ALE/Pong-v5"
    frame_skip: int = 4
    screen_size: int = 84
    frame_stack: int = 4
    noop_max: int = 30
    terminal_on_life_loss: bool = False
    repeat_action_probability: float | None = None  # None: the game id's own (v5, v0: 0.25; v4: 0)
    obs_type: str | None = None  # rgb (screens) | ram (128 bytes); None: ram for a RAM id, else rgb
    full_action_space: bool = False
    max_episode_frames: int = 108_000
    vector: str = "python"  # how an actor steps its envs: python | ale
    vector_threads: int = 1  # threads of the ale vector env per actor
    render_mode: str | None = None  # e.g. rgb_array for impala eval --video (python envs only)

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> AtariSettings:
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise EnvError(f"env.kwargs {unknown} are not Atari settings; valid: {names}")
        game, ram_id = split_ram_id(str(kwargs.get("game", cls.game)))
        given = kwargs.get("obs_type")
        if given is not None and given not in OBS_TYPES:
            raise EnvError(
                f"env.kwargs.obs_type={given!r} is not valid; valid: " + " | ".join(OBS_TYPES)
            )
        if ram_id and given == "rgb":
            raise EnvError(
                f"env.kwargs.obs_type=rgb with the RAM id {kwargs['game']!r}: give the "
                f"game's own id ({game}) for screens"
            )
        obs_type = "ram" if ram_id else (given or "rgb")
        settings = cls(**{**kwargs, "game": game, "obs_type": obs_type})
        if settings.obs_type == "ram" and settings.terminal_on_life_loss:
            raise EnvError(
                "env.kwargs.terminal_on_life_loss=true reads lives off the screens' wrapper: "
                "valid with env.kwargs.obs_type=rgb only"
            )
        if settings.vector not in VECTOR_BACKENDS:
            raise EnvError(
                f"env.kwargs.vector={settings.vector!r} is not valid; valid: "
                + " | ".join(VECTOR_BACKENDS)
            )
        if settings.vector == "ale" and settings.obs_type == "ram":
            raise EnvError(
                "env.kwargs.vector=ale steps screens only; for the game's RAM "
                "(env.kwargs.obs_type=ram) valid: env.kwargs.vector=python"
            )
        threads = settings.vector_threads
        if not (isinstance(threads, int) and threads >= 1):
            raise EnvError(f"env.kwargs.vector_threads={threads!r}: an integer >= 1")
        return settings


def make_atari_env(**kwargs: Any) -> gym.Env:
    """One Atari env as Gymnasium wrappers, with the :class:`AtariSettings` in ``kwargs``."""
    game = kwargs.get("game", AtariSettings.game)
    return _atari_env(AtariSettings.from_kwargs(kwargs), f"env.kwargs.game={game!r}")


def _atari_env(cfg: AtariSettings, named: str) -> gym.Env:
    """The game of ``cfg`` preprocessed; ``named``: how the user gave it, for errors."""
    try:
        import ale_py
    except ImportError:
        raise EnvError("Atari needs ale-py and opencv: pip install 'impala-rl[atari]'") from None
    gym.register_envs(ale_py)
    if cfg.obs_type == "ram":
        # ale-py skips the frames (RAM needs no max-pool over the last two screens); no-op
        # starts, then the last states stacked and flattened (positions in one, speeds across)
        env = NoopReset(
            _ale_env(cfg, named, obs_type="ram", frameskip=cfg.frame_skip), cfg.noop_max
        )
        env = gym.wrappers.FrameStackObservation(env, cfg.frame_stack, padding_type="zero")
        return gym.wrappers.FlattenObservation(env)
    env = _ale_env(cfg, named, frameskip=1)  # AtariPreprocessing skips frames and max-pools
    env = gym.wrappers.AtariPreprocessing(
        env,
        noop_max=cfg.noop_max,
        frame_skip=cfg.frame_skip,
        screen_size=cfg.screen_size,
        terminal_on_life_loss=cfg.terminal_on_life_loss,
        grayscale_obs=True,
        scale_obs=False,
    )
    # zero padding at an episode's start, as ale-py's vector env: both paths give equal frames
    return gym.wrappers.FrameStackObservation(env, cfg.frame_stack, padding_type="zero")


def _ale_env(cfg: AtariSettings, named: str, **observed: Any) -> gym.Env:
    """ale-py's env of the game with ``cfg``'s sticky actions, action set and frame limit;
    ``observed``: what it observes and how many frames a step skips."""
    try:
        return gym.make(
            cfg.game,
            repeat_action_probability=sticky_actions(cfg),
            full_action_space=cfg.full_action_space,
            max_num_frames_per_episode=cfg.max_episode_frames,
            render_mode=cfg.render_mode,
            disable_env_checker=True,
            **observed,
        )
    except gym.error.Error as exc:
        raise EnvError(f"{named}: {exc}") from None


class NoopReset(gym.Wrapper):
    """Up to ``noop_max`` no-op actions (action 0) after a reset, a random number of them drawn
    from the env's own generator (seeded by ``reset(seed=...)``), as AtariPreprocessing does for
    screens."""

    def __init__(self, env: gym.Env, noop_max: int):
        super().__init__(env)
        self.noop_max = int(noop_max)

    def reset(self, **kwargs: Any) -> Any:
        obs, info = self.env.reset(**kwargs)
        noops = int(self.env.unwrapped.np_random.integers(0, self.noop_max + 1))
        for _ in range(noops):
            obs, _, terminated, truncated, info = self.env.step(0)
            if terminated or truncated:
                obs, info = self.env.reset()
        return obs, info


def make_ale_id_env(env_id: str, **kwargs: Any) -> gym.Env:
    """``env.id=ALE/Pong-v5`` (or a legacy id, ``PongNoFrameskip-v4``: :func:`is_ale_id`) as a
    plain id: ale-py's ids are registered on demand and the raw
    RGB frames get :func:`make_atari_env`'s preprocessing (the ``atari`` preset's), since
    210x160x3 channels-last frames fit none of the encoders; ``kwargs`` are
    :class:`AtariSettings` other than ``game``."""
    if "game" in kwargs:
        raise EnvError(
            f"env.kwargs.game={kwargs['game']!r} with env.id={env_id!r}: give the game once, "
            "as env.id (or env.id=impala_rl.envs.atari:make_atari_env with env.kwargs.game)"
        )
    return _atari_env(AtariSettings.from_kwargs({"game": env_id, **kwargs}), f"env.id {env_id!r}")


LEGACY_ID = re.compile(r"[A-Z][A-Za-z]*?(NoFrameskip)?-v[04]")
"""Gymnasium's ids of the ALE games before the ``ALE/`` namespace, which ale-py still
registers: ``PongNoFrameskip-v4`` (the DQN papers' and many tutorials'), ``Breakout-v4``."""


def _ale_spec(env_id: str) -> Any:
    """ale-py's Gymnasium spec of ``env_id`` (registering ale-py's ids on demand), or None when
    ale-py is missing or registers no such id."""
    if env_id not in gym.registry:
        try:
            import ale_py
        except ImportError:
            return None
        gym.register_envs(ale_py)
    spec = gym.registry.get(env_id)
    if spec is None or "ale_py" not in str(spec.entry_point):
        return None
    return spec


def is_ale_id(env_id: str) -> bool:
    """Whether ``env_id`` is an ALE game's Gymnasium id: ``ALE/Pong-v5``, or a legacy one
    (:data:`LEGACY_ID`, ``PongNoFrameskip-v4``) that ale-py registers. Both get the Atari
    preprocessing; an id of another package that merely looks legacy (``CartPole-v0``) does
    not."""
    if env_id.startswith("ALE/"):
        return True
    env_id = split_ram_id(env_id)[0]
    return bool(LEGACY_ID.fullmatch(env_id)) and _ale_spec(env_id) is not None


def is_registered_game(env_id: str) -> bool:
    """Whether ale-py registers ``env_id`` (a RAM id: its game's id), registering its ids on
    demand."""
    return _ale_spec(split_ram_id(env_id)[0]) is not None


def reads_ram(env_id: str, kwargs: dict[str, Any]) -> bool:
    """Whether an ALE game's id with these ``env.kwargs`` observes the console's RAM."""
    return split_ram_id(env_id)[1] or kwargs.get("obs_type") == "ram"


def sticky_actions(settings: AtariSettings) -> float:
    """``repeat_action_probability``: the setting, or where it is None the game id's own (v5
    and v0 ids: 0.25, v4 ids: 0), 0.25 for an id ale-py does not register."""
    if settings.repeat_action_probability is not None:
        return float(settings.repeat_action_probability)
    spec = _ale_spec(settings.game)
    return float(spec.kwargs.get("repeat_action_probability", 0.25)) if spec else 0.25


def ale_rom_id(game: str) -> str:
    """ale-py's ROM id for a Gymnasium id: ``ALE/SpaceInvaders-v5`` and
    ``SpaceInvadersNoFrameskip-v4`` -> ``space_invaders``."""
    spec = _ale_spec(game)
    if spec is not None and "game" in spec.kwargs:
        return str(spec.kwargs["game"])
    name = game.split("/")[-1].split("-")[0].removesuffix("NoFrameskip")
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def make_atari_vector_env(num_envs: int, **kwargs: Any) -> Any:
    """``num_envs`` envs as ale-py's C++ vector env (``vector=ale``) with the preprocessing of
    :func:`make_atari_env` and same-step autoreset (the final observation in
    ``info["final_obs"]``), or ``None`` for ``vector=python``."""
    cfg = AtariSettings.from_kwargs(kwargs)
    if cfg.vector == "python":
        return None
    try:
        from ale_py.vector_env import AtariVectorEnv
    except ImportError:
        raise EnvError(
            "env.kwargs.vector=ale needs ale-py >= 0.10: pip install 'impala-rl[atari]'"
        ) from None

    class SeededAtariVectorEnv(AtariVectorEnv):
        """ale-py's seeds are C ints: an int seed is folded into their range."""

        def reset(self, *, seed: Any = None, options: Any = None) -> Any:
            if isinstance(seed, int):
                seed %= 2**31 - 1 - self.num_envs
            return super().reset(seed=seed, options=options)

    try:
        return SeededAtariVectorEnv(
            ale_rom_id(cfg.game),
            num_envs,
            num_threads=min(cfg.vector_threads, num_envs),
            autoreset_mode="SameStep",
            max_num_frames_per_episode=cfg.max_episode_frames,
            repeat_action_probability=sticky_actions(cfg),
            full_action_space=cfg.full_action_space,
            img_height=cfg.screen_size,
            img_width=cfg.screen_size,
            grayscale=True,
            stack_num=cfg.frame_stack,
            frameskip=cfg.frame_skip,
            maxpool=True,
            noop_max=cfg.noop_max,
            episodic_life=cfg.terminal_on_life_loss,
            reward_clipping=False,  # the learner clips (algorithm.reward_clipping)
            use_fire_reset=False,  # as Gymnasium's AtariPreprocessing
        )
    except (RuntimeError, ValueError) as exc:
        raise EnvError(f"env.kwargs.game={cfg.game!r} with env.kwargs.vector=ale: {exc}") from None


make_atari_env.make_vector = make_atari_vector_env  # type: ignore[attr-defined]
