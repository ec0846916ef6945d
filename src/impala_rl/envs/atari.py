"""Atari through ale-py (which ships the ROMs) with the standard DQN/IMPALA preprocessing.

Use it as ``env.id=impala_rl.envs.atari:make_atari_env`` with ``env.kwargs.game=ALE/Pong-v5``.
Observations are ``uint8 [frame_stack, 84, 84]`` and stay ``uint8`` up to the network.
"""

from __future__ import annotations

import gymnasium as gym

from impala_rl.envs.factory import EnvError


def make_atari_env(
    game: str = "ALE/Pong-v5",
    frame_skip: int = 4,
    screen_size: int = 84,
    frame_stack: int = 4,
    noop_max: int = 30,
    terminal_on_life_loss: bool = False,
    repeat_action_probability: float = 0.25,
    full_action_space: bool = False,
    max_episode_frames: int = 108_000,
) -> gym.Env:
    """An ALE game with noop resets, frame skip with max-pooling over the last two frames,
    grayscale ``screen_size`` x ``screen_size`` frames, a stack of ``frame_stack`` frames,
    optional episodic life, and v5's sticky actions (``repeat_action_probability``)."""
    try:
        import ale_py
    except ImportError:
        raise EnvError("Atari needs ale-py and opencv: pip install 'impala-rl[atari]'") from None
    gym.register_envs(ale_py)
    try:
        env = gym.make(
            game,
            frameskip=1,  # AtariPreprocessing skips frames and max-pools
            repeat_action_probability=repeat_action_probability,
            full_action_space=full_action_space,
            max_num_frames_per_episode=max_episode_frames,
            disable_env_checker=True,
        )
    except gym.error.Error as exc:
        raise EnvError(f"env.kwargs.game={game!r}: {exc}") from None
    env = gym.wrappers.AtariPreprocessing(
        env,
        noop_max=noop_max,
        frame_skip=frame_skip,
        screen_size=screen_size,
        terminal_on_life_loss=terminal_on_life_loss,
        grayscale_obs=True,
        scale_obs=False,
    )
    return gym.wrappers.FrameStackObservation(env, frame_stack)
