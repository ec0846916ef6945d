"""What ``impala train env.id=ID`` runs without a preset: settings that fit the env.

The env's family picks a preset, said on the console:

- Gymnasium's families with a preset (``classic_control``, ``box2d``, ``mujoco``: the package of
  the env's entry point);
- by id: ``MiniGrid-...`` and ``BabyAI-...`` the ``minigrid`` preset, ``MinAtar/...`` the
  ``minatar`` preset (``minatar_breakout`` for Breakout; ``minatar_short``, sample reuse, for a
  ``max_env_steps`` of at most 1M), ``ALE/...`` (and the legacy ids ale-py registers,
  ``PongNoFrameskip-v4``) the ``pong_appo`` preset's learning settings with the Atari
  preprocessing (the game id's own sticky actions); a game's RAM (``env.kwargs.obs_type=ram``,
  or gym's ``ALE/Pong-ram-v5``) is a vector, which ``any_env`` reads;
- any other env the ``any_env`` preset: nearly on-policy batches reused under the clipped
  surrogate (the family presets' settings), fitted to the env's spaces.

The spaces decide the network (:func:`describe_spaces`) for ``any_env`` and for a family
preset that names no encoder (CarRacing under ``box2d``): a CNN with one shared torso for an
image observation (the Nature CNN from 36 pixels a side, the MinAtar CNN below; one under 3
pixels a side is read as a vector; every ``uint8`` image reaches the model as ``[C, H, W]``),
an encoder per entry for a Dict, observation normalization where there are vectors to
normalize. On top, for every env:

- ``target_return``: the env's Gymnasium ``spec.reward_threshold`` where it defines one, else
  ``null`` (no early stop), never another env's target;
- for ``any_env``: evaluation in a process of its own, at most ~10% of the wall time
  (``rollout_evaluator.max_time_share``), the final weights evaluated at the end;
  ``patience: 0`` and a budget of 1M env steps (``max_env_steps`` overrides it); where the
  model runs a CNN, PPO's Atari reuse (:data:`IMAGE_REUSE`, 4 passes x 4 minibatches) and 2
  learner threads where 2 cores are idle at start-up (:data:`CNN_LEARNER_THREADS`);
- for ``any_env`` and a family preset that steps an actor's envs one after the other in the
  learner's process (the sequential backend, ``env.vector=python``), where one step of the env
  costs :data:`SLOW_STEP_S` or more (timed on the probe: CarRacing, not MuJoCo's 0.1-0.6 ms),
  ``env.vector=async``: an actor's envs step at once, each in its own process, on every core
  (the same episodes, the batches as on-policy as before).

The user's ``key=value`` overrides go on top, so an explicit setting always wins.
With neither a preset nor ``env.id`` the ``cartpole`` preset runs (CartPole-v1, tuned).
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import gymnasium as gym
import numpy as np

from impala_rl.config import (
    VECTOR_ENCODERS,
    ConfigError,
    RunConfig,
    check_rules,
    compile_pays,
    decay_horizon,
    load_config,
    merge_config,
    one_program_refusal,
    pixel_convolutions,
    planned_optimizer_steps,
    user_file_keys,
)
from impala_rl.envs import EnvError, EnvFactory
from impala_rl.envs.atari import (
    AtariSettings,
    is_ale_id,
    reads_ram,
    split_ram_id,
    sticky_actions,
)
from impala_rl.envs.factory import unreadable_file
from impala_rl.envs.structured import KeyObservation, MaskedActionsEnv, is_structured
from impala_rl.machine import available_cores, idle_cores
from impala_rl.nn.encoders import (
    IMAGE_ENCODERS,
    encoder_for,
    fitting_cnn,
    is_cnn_image,
    is_image,
    largest_image_side,
)
from impala_rl.sizing import size_to_machine
from impala_rl.startup import resolve_device

log = logging.getLogger(__name__)

DEFAULT_PRESET = "cartpole"
"""What runs with neither a preset nor ``env.id``."""
FAMILY_PRESETS = ("classic_control", "box2d", "mujoco")
"""Gymnasium's env families (``gymnasium.envs.<family>``) with a preset of the same name."""
ALE_PRESET = "pong_appo"
"""The learning settings of an ALE game's id (``ALE/...`` or legacy, :func:`is_ale_id`)."""
ID_PRESETS: tuple[tuple[str, str, str], ...] = (
    ("MiniGrid-", "minigrid", "MiniGrid"),
    ("BabyAI-", "minigrid", "BabyAI"),
    ("MinAtar/Breakout-", "minatar_breakout", "MinAtar Breakout"),
    ("MinAtar/", "minatar", "MinAtar"),
    ("ALE/", ALE_PRESET, "ALE"),
)
"""Id prefixes of families with a preset: prefix, preset, family name."""
SHORT_BUDGET_PRESETS = {"minatar": "minatar_short", "minatar_breakout": "minatar_short"}
"""Family presets chosen for budgets of millions of env steps, and what replaces them when the
user's ``max_env_steps`` is at most :data:`SHORT_BUDGET` (sample reuse)."""
SHORT_BUDGET = 1_000_000
BOARD_GAMES = "pettingzoo.classic."
"""``env.id=pettingzoo.classic.connect_four_v3``: PettingZoo's board and card games, played
against others: trained against random legal moves in half the games and itself in the rest
(``mixed``), evaluated against random legal moves, so the best model is chosen on a win rate
(the tictactoe experiments: self-play alone 72-76% against random, mixed 92.6%), on 200 games
an evaluation."""
BOARD_GAME_SETTINGS = {
    "env.kwargs.opponent": "mixed",
    "env.eval_kwargs.opponent": "random",
    # a win rate of 10 games is a lottery for the best-model choice (the tictactoe preset's 200)
    "algorithm.rollout_evaluator.n_episodes": 200,
}
GENERIC_PRESET = "any_env"
"""What an env of no known family runs."""
MAX_ENV_STEPS = 1_000_000
EVAL_TIME_SHARE = 0.1
SLOW_STEP_S = 1e-3
"""A step this slow (a millisecond, as the probe times it) puts each env in a process of its own
(``env.vector=async``). Below it the round trip to each env's process costs what the other core
gives back: raw stepping of 8 copies on 2 cores, async over python, 0.45-0.69x for Hopper, Ant
and Humanoid (0.2-0.6 ms), 0.86x for Ant slowed to 0.71 ms, 1.03x at 1.11 ms, 1.22x at 1.56 ms;
CarRacing (9-19 ms) 1.24-1.6x (``benchmarks/async_envs.py``, docs/experiments/any-env.md)."""
STEP_TIMING_S = 0.25  # the probe steps this long, or 200 steps, whichever ends first
IMAGE_REUSE = (4, 4)
"""Passes and minibatches per batch for an ``any_env`` model that runs a CNN: PPO's Atari
reuse (CleanRL's and RL Zoo's 4 epochs of 4 minibatches of 256 steps; the PPO paper's 3 epochs
of 256). 10 x 16, PPO's default for vectors, kept Catch's learner busy 84% of its run: 4 x 4
trains Catch in a third of the time to the same or better scores (``benchmarks/any_env.py``,
3 seeds; docs/experiments/any-env.md)."""
CNN_LEARNER_THREADS = 2
"""Torch threads for an ``any_env`` learner that runs a CNN (an image observation, plain or in
a Dict), at most the cores other processes leave idle at start-up: the sequential backend
leaves the other core idle, and Catch's update took 0.75x one thread's time on 2 cores
(``benchmarks/batch_update.py``); beside one busy process the second thread's waits made
Catch's run 3.5x one thread's. An MLP's (PointGoal: 0.89x, within the spread) keeps one."""


def _spec(env_id: str) -> Any:
    """Gymnasium's spec of a registered id; None for a ``module:callable`` factory or an id
    Gymnasium does not know."""
    if ":" in env_id:
        return None
    try:
        return gym.spec(env_id)
    except Exception:  # unknown ids, namespaces not registered
        return None


def reward_threshold(env_id: str) -> float | None:
    """The env's Gymnasium ``spec.reward_threshold``; None for a ``module:callable`` factory,
    an id Gymnasium does not know, or a spec without one."""
    threshold = getattr(_spec(env_id), "reward_threshold", None)
    return None if threshold is None else float(threshold)


def env_family(env_id: str) -> str | None:
    """The Gymnasium family of a registered id (``classic_control`` for ``Pendulum-v1``:
    the package under ``gymnasium.envs`` of its entry point); None for anything else."""
    entry = getattr(_spec(env_id), "entry_point", None)
    if not isinstance(entry, str) or not entry.startswith("gymnasium.envs."):
        return None
    return entry.split(":", 1)[0].split(".")[2]


def family_preset(env_id: str) -> tuple[str, str] | None:
    """``(preset, family)`` for an id of a family with a preset (:data:`ID_PRESETS`, then
    Gymnasium's :data:`FAMILY_PRESETS`); None for any other env."""
    for prefix, preset, family in ID_PRESETS:
        if env_id.startswith(prefix):
            return preset, family
    if is_ale_id(env_id):  # a legacy id ale-py registers: PongNoFrameskip-v4
        return ALE_PRESET, "ALE"
    family = env_family(env_id)
    if family in FAMILY_PRESETS:
        return family, f"Gymnasium's {family}"  # type: ignore[return-value]
    return None


def _steps_in_one_process(preset: RunConfig) -> bool:
    """Whether ``preset`` steps an actor's envs one after the other in the learner's process:
    then a slow step is worth timing."""
    return preset.runner.backend == "sequential" and preset.env.vector == "python"


def _check_given_encoder(encoder: str, observation: Any, env_id: str, spaces: str) -> None:
    """Refuse a built-in CNN given for an env whose observations are not images, naming the
    encoder (the preset's other model settings would otherwise be blamed first)."""
    plain = isinstance(observation, gym.spaces.Box)
    if encoder in IMAGE_ENCODERS and plain and not is_image(observation):
        raise ConfigError(
            f"invalid value for 'model.encoder': {encoder!r}; valid: "
            f"{' | '.join(VECTOR_ENCODERS)} | package.module:Class for {env_id} ({spaces}, "
            f"shape {observation.shape}): {encoder} reads uint8 images [C, H, W]"
        )


ATARI_MAKER = "impala_rl.envs.atari:make_atari_env"


def _check_screens_read(cfg: RunConfig) -> None:
    """Refuse a preset's image encoder on an ALE game's RAM (``env.kwargs.obs_type=ram``, a
    RAM id) before the env is built: the Atari presets' CNN reads screens, and the id form
    gives a game's RAM the settings of a vector env."""
    env_cfg, encoder = cfg.env, cfg.model.encoder
    if encoder not in IMAGE_ENCODERS:
        return
    if env_cfg.id == ATARI_MAKER:
        game = str(env_cfg.kwargs.get("game", AtariSettings.game))
    elif is_ale_id(env_cfg.id):
        game = env_cfg.id
    else:
        return
    if not reads_ram(game, env_cfg.kwargs):
        return
    raise ConfigError(
        f"invalid value for 'model.encoder': {encoder!r} for the RAM of {game} (128 bytes a "
        f"frame, a vector); valid: {' | '.join(VECTOR_ENCODERS)} | package.module:Class. Or "
        f"run `impala train env.id={split_ram_id(game)[0]} env.kwargs.obs_type=ram` for the "
        "settings of a vector env"
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _overridden(overrides: list[str], key: str) -> bool:
    return any(item.split("=", 1)[0].strip() == key for item in overrides)


def describe_spaces(env: Any, entries: bool = True) -> tuple[str, dict[str, Any]]:
    """``("discrete actions, vector observations", model settings)`` for one built env (its
    observations as the model takes them: images ``[C, H, W]``; ``entries`` as
    ``env.observation_entries``)."""
    action = env.action_space
    if isinstance(action, (gym.spaces.Discrete, gym.spaces.MultiDiscrete)):
        actions = "discrete actions"
    elif isinstance(action, gym.spaces.Box):
        actions = "continuous actions"
    else:
        actions = f"{type(action).__name__} actions"
    if is_structured(env):
        what = ", a CNN per image" if has_image(env, entries) else ""
        if isinstance(env, MaskedActionsEnv):
            return f"{actions} masked by {env.mask_from}{what}", {}
        return f"a structured env (spaces per step key{what})", {}
    obs = env.observation_space
    if isinstance(obs, gym.spaces.Dict):
        entries = obs.spaces.values()
        vectors = any(_is_vector(e) for e in entries)
        what = "Dict observations (an encoder per entry"
        what += ", a CNN per image" if has_image(env, entries) else ""
        model = {} if vectors else {"normalize_obs": False}
        return f"{actions}, {what})", model
    if not is_cnn_image(obs):  # vectors, or an image too small for a convolution
        return f"{actions}, vector observations", {}
    c, h, w = obs.shape
    model = {"encoder": fitting_cnn(obs.shape), "shared_torso": True, "normalize_obs": False}
    return f"{actions}, image observations [{c}, {h}, {w}]", model


def step_seconds(env: Any, budget_s: float = STEP_TIMING_S, max_steps: int = 200) -> float:
    """What one step of ``env`` (a plain env) costs on an idle machine, under seeded random
    actions, resets not counted: this thread's mean CPU time a step plus the median of the
    rest of each step's wall time. A step that waits on something (a simulator's own thread, a
    socket) waits on every step and is counted; a step that waited for a core other processes
    held is rare at microseconds a step and is not, so a busy machine does not read MuJoCo's
    Ant (0.2 ms) as slow (its mean wall time was 1.1 ms beside 10 busy processes on 2 cores).
    0.0 for a structured env (its step takes each agent's turn) and for an env that refuses a
    random action (one with masked actions): it then keeps one process."""
    if is_structured(env):
        return 0.0
    env.action_space.seed(0)
    env.reset(seed=0)
    cpu, waits, spent = 0.0, [], 0.0
    while spent < budget_s and len(waits) < max_steps:
        action = env.action_space.sample()
        start, start_cpu = time.perf_counter(), time.thread_time()
        try:
            _, _, terminated, truncated, _ = env.step(action)
        except Exception:
            return 0.0
        step_cpu, wall = time.thread_time() - start_cpu, time.perf_counter() - start
        cpu += step_cpu
        waits.append(max(wall - step_cpu, 0.0))
        spent += wall
        if terminated or truncated:
            env.reset()
    return cpu / len(waits) + statistics.median(waits)


def model_observations(env: Any, entries: bool = True) -> list[gym.Space]:
    """``env``'s observation spaces as the model takes them: one, or a structured env's per
    step key (``entries`` as ``env.observation_entries``)."""
    if is_structured(env):
        return [KeyObservation(s, k, entries).space for k, s in env.observation_spaces.items()]
    return [env.observation_space]


def has_image(env: Any, entries: bool = True) -> bool:
    """Whether ``env``'s observation is an image that the model reads with a CNN
    (:func:`~impala_rl.nn.encoders.is_cnn_image`), or a Dict holding one, for a structured env
    under any step key."""
    read = [
        entry
        for obs in model_observations(env, entries)
        for entry in (obs.spaces.values() if isinstance(obs, gym.spaces.Dict) else [obs])
    ]
    return any(is_cnn_image(e) for e in read)


def _is_vector(space: Any) -> bool:
    """A float32 vector entry, which observation normalization normalizes."""
    return isinstance(space, gym.spaces.Box) and space.dtype == np.float32


def env_defaults(overrides: list[str], sizing_follows: bool = False) -> tuple[RunConfig, str]:
    """The config for ``overrides`` (which set ``env.id``) on the preset of the env's family or
    the ``any_env`` preset fitted to its spaces, and the console line saying what was chosen.
    Builds the env once to read its spaces.

    Only the ``env`` section is checked before the probe; the rest is validated once, on the
    config that runs (the preset chosen here may supply what an override needs, e.g. the
    ``max_env_steps`` a linear schedule decays over; with ``sizing_follows``, a preset that
    is sized gets the rules between fields on its sized values: :func:`load_config`)."""
    probe_cfg = merge_config(overrides=overrides)
    check_rules(probe_cfg, "env")
    env_cfg = probe_cfg.env
    family = family_preset(env_cfg.id)
    ram = is_ale_id(env_cfg.id) and reads_ram(env_cfg.id, env_cfg.kwargs)
    if ram:  # vectors: the ALE preset's CNN reads screens
        family = None
    preset_cfg = load_config(GENERIC_PRESET if family is None else family[0])  # as written
    probe = EnvFactory.of(env_cfg, vector="python")()
    try:
        entries = env_cfg.observation_entries
        spaces, model = describe_spaces(probe, entries)
        images = has_image(probe, entries)
        image_side = largest_image_side(model_observations(probe, entries))
        step_s = step_seconds(probe) if _steps_in_one_process(preset_cfg) else 0.0
        step_keys = len(probe.observation_spaces) if is_structured(probe) else 1
        observation = None if is_structured(probe) else probe.observation_space
    except OSError as exc:  # an env that reads its files on reset or step
        raise EnvError(
            f"env.id {env_cfg.id!r} could not be probed: {unreadable_file(exc)}"
        ) from None
    finally:
        probe.close()
    _check_given_encoder(probe_cfg.model.encoder, observation, env_cfg.id, spaces)
    slow = step_s >= SLOW_STEP_S and not _overridden(overrides, "runner.backend")
    # A family preset that names no encoder (Gymnasium's, tuned on vectors) leaves the network
    # to the spaces as any_env does: CarRacing's frames get a CNN, not an MLP over 27,648 pixels.
    fits_spaces = family is None or preset_cfg.model.encoder == "auto"
    # the sequential backend's idle core (actors in processes of their own take the others)
    cnn_threads = fits_spaces and images and not _overridden(overrides, "runner.backend")
    threshold = reward_threshold(env_cfg.id)
    derived = [f"target_return={'null' if threshold is None else threshold}"]
    busy_note = ""
    if family is None:  # a family preset has its schedule and budget
        preset = GENERIC_PRESET
        derived += [
            f"max_env_steps={MAX_ENV_STEPS}",
            "algorithm.patience=0",
            "algorithm.rollout_evaluator.background=process",
            f"algorithm.rollout_evaluator.max_time_share={EVAL_TIME_SHARE}",
        ]
    else:
        preset = family[0]
    board_game = env_cfg.id.startswith(BOARD_GAMES)
    if board_game:  # what the tictactoe experiments found: both opponents, a win rate to read
        derived += [
            f"{key}={value}"
            for key, value in BOARD_GAME_SETTINGS.items()
            if not _overridden(overrides, key)
        ]
    if slow:
        derived.append("env.vector=async")
    if fits_spaces:
        derived += [f"model.{key}={value}" for key, value in model.items()]
        if images:
            passes, minibatches = IMAGE_REUSE
            derived += [
                f"algorithm.num_passes={passes}",
                f"algorithm.num_minibatches={minibatches}",
            ]
        if cnn_threads and not _overridden(overrides, "runner.learner_threads"):
            # a core another process keeps busy makes each op of a 2-thread team wait for it
            most = min(CNN_LEARNER_THREADS, available_cores())
            idle = idle_cores() if most > 1 else 1.0
            threads = max(1, min(most, round(idle)))
            derived.append(f"runner.learner_threads={threads}")
            if threads < most:
                busy_note = f" ({idle:.1f} of {available_cores()} cores idle at start-up)"
    note = ""
    budget = probe_cfg.max_env_steps  # None unless an override gives it (no preset under it)
    if preset in SHORT_BUDGET_PRESETS and budget is not None and budget <= SHORT_BUDGET:
        preset = SHORT_BUDGET_PRESETS[preset]
        note = f"; a budget of {budget:,} env steps <= {SHORT_BUDGET:,}: sample reuse"
    cfg = load_config(preset, [*derived, *overrides], sizing_follows=sizing_follows)
    if is_ale_id(env_cfg.id):  # the game is env.id; sticky actions are the id's own
        for key in ("game", "repeat_action_probability"):
            if not _overridden(overrides, f"env.kwargs.{key}"):
                cfg.env.kwargs.pop(key, None)
        settings = AtariSettings.from_kwargs({"game": env_cfg.id, **cfg.env.kwargs})
        if ram:
            seen = f"{settings.frame_stack} states of its 128 bytes of RAM stacked"
        else:
            seen = (
                f"{settings.screen_size}x{settings.screen_size} grayscale, "
                f"{settings.frame_stack} frames stacked"
            )
        note = (
            f" (Atari preprocessing: a frame skip of {settings.frame_skip}, {seen}; sticky "
            f"actions {sticky_actions(settings):g})"
        )
    if _overridden(overrides, "target_return"):
        given = cfg.target_return
        target = "no target_return (given)" if given is None else f"target_return {given:g} (given)"
    elif threshold is not None:
        target = f"target_return {threshold:g} from the env spec"
    else:
        target = "no target_return (the env spec has no reward_threshold)"
    a, ev = cfg.algorithm, cfg.algorithm.rollout_evaluator
    if ev.max_time_share is None:
        evaluation = "evaluation every epoch"
    else:
        evaluation = f"evaluation at most {ev.max_time_share:.0%} of the time"
    if ev.background == "process":
        evaluation += " in a process of its own"
    else:
        evaluation += " in the background" if ev.background else " in the pause"
    if ram:
        chosen = f"an ALE game's RAM, vectors: the {preset} preset{note}"
    elif family is None:
        chosen = f"no preset of its family: the {preset} preset"
    else:
        chosen = f"the {preset} preset ({family[1]} env{note})"
    of = " of single decisions" if a.minibatch_of == "steps" else ""
    reuse = f"{a.num_passes} passes x {a.num_minibatches} minibatches{of}"
    if fits_spaces and images and (a.num_passes, a.num_minibatches) == IMAGE_REUSE:
        reuse += " (PPO's Atari reuse for the CNN)"
    reuse = f"{reuse}, " if a.num_passes > 1 else ""
    lr = f"lr {a.lr:g}"
    if a.lr_schedule == "linear":
        horizon = decay_horizon(a, "lr", cfg.max_env_steps)
        lr += f" decaying to {a.lr_final:g}" + (f" over {horizon:,} env steps" if horizon else "")
    backend = f"{cfg.runner.backend} backend"
    if cnn_threads:
        threads = _count(cfg.runner.learner_threads, "learner thread")
        backend += f", {threads} for the CNN{busy_note}"
    if slow and cfg.env.vector == "async":
        backend += f", each env in its own process (a step takes {step_s * 1e3:.1f} ms)"
    # the learner's own rule and refusals, from what the config and the probe show (images:
    # the model's CNN)
    wanted = a.compile_update
    if wanted is None:
        wanted = compile_pays(pixel_convolutions(images, image_side), planned_optimizer_steps(cfg))
    refusal = one_program_refusal(
        several_learners=a.num_learners > 1,
        step_keys=step_keys,
        lstm_core=cfg.model.core != "none",
        precision=cfg.model.precision,
    )
    if wanted and refusal is None and resolve_device(a.device).type == "cpu":
        backend += ", the update compiled (torch.compile)"
    encoder = encoder_for(cfg.model.encoder, observation) if observation is not None else "auto"
    encoder = "encoders fitted to the spaces" if encoder == "auto" else f"{encoder} encoder"
    if board_game:
        against = {"mixed": "itself and random legal moves", "random": "random legal moves"}
        train = cfg.env.kwargs.get("opponent", "self_play")
        evaluated = cfg.env.eval_kwargs.get("opponent", train)
        evaluation += (
            f"; a board game: trained against {against.get(train, 'itself')}, evaluated "
            f"against {against.get(evaluated, 'itself')}"
        )
    line = (
        f"{chosen} for {env_cfg.id} ({spaces}); {target}; {evaluation}; "
        f"{encoder}, {a.policy_loss} loss, {reuse}{lr}, "
        f"{backend}, {_count(a.num_actors, 'actor')} x {_count(a.envs_per_actor, 'env')}, "
        f"unroll {a.n_rollout_steps}, max_env_steps {cfg.max_env_steps}"
    )
    return cfg, line


def resolve_config(preset: Any, overrides: list[str] | None = None) -> RunConfig:
    """``impala train [PRESET] [key=value ...]``'s config: the preset (a name or YAML path)
    when given; else defaults for ``env.id`` (:func:`env_defaults`, said on the log); else the
    ``cartpole`` preset. Sized to the machine where it asks to be (:mod:`impala_rl.sizing`)."""
    overrides = list(overrides or [])
    if preset is not None:
        cfg = load_config(preset, overrides, sizing_follows=True)
        _check_screens_read(cfg)
    elif not _overridden(overrides, "env.id"):
        log.info("no preset and no env.id: the %s preset", DEFAULT_PRESET)
        cfg = load_config(DEFAULT_PRESET, overrides, sizing_follows=True)
    else:
        cfg, line = env_defaults(overrides, sizing_follows=True)
        log.info("%s", line)
    given = user_file_keys(preset) if preset is not None else set()
    return size_to_machine(cfg, overrides, given=given)
