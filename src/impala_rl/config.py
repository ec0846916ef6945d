"""Typed run configuration: dataclasses, YAML presets, ``key=value`` overrides, validation.

The run config has top-level keys (``seed`` and the stop conditions) and one section per
concern: ``algorithm`` (:class:`ImpalaAlgorithmConfig`, the field names Maze-RL users know),
``env``, ``model``, ``runner`` and ``log``. OmegaConf merges presets and overrides against the
dataclass schema, which refuses unknown keys and wrong types; :func:`validate` then checks
ranges and choices. Every error is a :class:`ConfigError` naming the field and what is valid.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

PRESETS_DIR = Path(__file__).parent / "configs"

REWARD_CLIPPING_MODES = ("none", "abs_one", "soft_asymmetric")
OPTIMIZERS = ("adam", "rmsprop")
LR_SCHEDULES = ("constant", "linear")
BACKENDS = ("sequential", "subprocess", "ray")
START_METHODS = ("forkserver", "spawn", "fork")
ACTIVATIONS = ("tanh", "relu", "elu", "gelu", "silu")
ENCODERS = ("mlp", "nature_cnn", "impala_resnet", "minatar_cnn")
CORES = ("none", "lstm")
PRECISIONS = ("fp32", "bf16")
CRITIC_MODES = ("per_step_key", "shared")
VECTOR_ENVS = ("auto", "python", "envpool")


class ConfigError(ValueError):
    """A config that cannot run: the message names the field and what would be valid."""


@dataclass
class RolloutEvaluatorConfig:
    """How the policy is evaluated after every epoch (drives best-model selection)."""

    n_episodes: int = 10
    """Episodes per evaluation, run in parallel in one vector env."""
    deterministic: bool = True
    """Take the mode of the action distribution instead of sampling."""
    max_episode_steps: int | None = None
    """Cut evaluation episodes after this many steps (``null``: the env's own limit)."""


@dataclass
class ImpalaAlgorithmConfig:
    """IMPALA hyper-parameters, named as in Maze-RL's ``ImpalaAlgorithmConfig``."""

    n_epochs: int = 0
    """Number of epochs to train; ``<= 0`` runs until another stop condition is met."""
    epoch_length: int = 25
    """Learner updates per epoch; statistics, evaluation and checkpoints happen per epoch."""
    patience: int = 15
    """Stop after this many epochs without a better evaluation return (``<= 0``: never)."""
    critic_burn_in_epochs: int = 0
    """Epochs at the start in which only the critic learns (policy and entropy terms off)."""
    n_rollout_steps: int = 32
    """Unroll length T: env steps per actor rollout."""
    lr: float = 5e-4
    """Learning rate (the schedule's initial value)."""
    lr_schedule: str = "constant"
    """``constant`` or ``linear`` (decays to ``lr_final`` over ``lr_decay_env_steps``)."""
    lr_final: float = 0.0
    """Final learning rate of the linear schedule."""
    lr_decay_env_steps: int | None = None
    """Env steps over which the linear schedule decays (``null``: ``max_env_steps``)."""
    gamma: float = 0.99
    """Discount factor."""
    policy_loss_coef: float = 1.0
    """Weight of the policy-gradient loss."""
    value_loss_coef: float = 0.5
    """Weight of the baseline (critic) loss."""
    entropy_coef: float = 0.01
    """Weight of the entropy bonus."""
    max_grad_norm: float | None = 40.0
    """Clip the global gradient norm to this value (``null`` or ``0``: no clipping)."""
    optimizer: str = "adam"
    """``adam`` or ``rmsprop``."""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam's (beta1, beta2)."""
    rmsprop_alpha: float = 0.99
    """RMSProp smoothing constant (the paper: 0.99)."""
    rmsprop_momentum: float = 0.0
    """RMSProp momentum (the paper: 0)."""
    optimizer_eps: float = 1e-8
    """Optimizer epsilon (the paper's RMSProp: 0.01)."""
    device: str = "cpu"
    """Learner device: ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (cuda when available)."""
    queue_out_of_sync_factor: float = 1.0
    """At most ``factor * actors_batch_size`` finished rollouts wait for the learner."""
    actors_batch_size: int = 2
    """Rollouts (one per actor unroll) gathered into one learner batch."""
    num_actors: int = 2
    """Actors, each stepping a vector env of ``envs_per_actor`` environments."""
    envs_per_actor: int = 8
    """Environments per actor; a batch has ``actors_batch_size * envs_per_actor`` columns."""
    vtrace_clip_rho_threshold: float | None = 1.0
    """rho-bar: clips the importance weight in the V-trace targets (``null``: no clipping)."""
    vtrace_clip_pg_rho_threshold: float | None = 1.0
    """Clips the importance weight in the policy-gradient advantage (``null``: no clipping)."""
    vtrace_clip_c_threshold: float | None = 1.0
    """c-bar: clips the trace-cutting coefficients (``null``: no clipping)."""
    vtrace_lambda: float = 1.0
    """lambda in c_t = lambda * min(c-bar, rho_t); 1 is the paper's V-trace."""
    reward_clipping: str = "none"
    """``none``, ``abs_one`` (clip to [-1, 1]) or ``soft_asymmetric`` (the paper's tanh clip)."""
    max_policy_lag: int | None = None
    """Drop rollouts more than this many updates behind the learner (``null``: keep all)."""
    rollout_evaluator: RolloutEvaluatorConfig = field(default_factory=RolloutEvaluatorConfig)
    """Evaluation after every epoch."""


@dataclass
class EnvConfig:
    """What to train on."""

    id: str = "CartPole-v1"
    """A Gymnasium id, or ``package.module:callable`` returning a Gymnasium env."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for ``gymnasium.make`` or the factory."""
    max_episode_steps: int | None = None
    """Time limit (truncation) on top of the env's own (``null``: the env's own)."""
    vector: str = "auto"
    """How an actor steps its envs: ``python`` (one after the other), ``envpool`` (envpool's
    C++ vector env, classic control ids) or ``auto`` (envpool for ids it steps faster, e.g.
    CartPole, when it is installed and ``kwargs`` is empty; else ``python``)."""
    eval_kwargs: dict[str, Any] = field(default_factory=dict)
    """Entries that replace ``kwargs`` for the evaluation env (e.g. a fixed opponent)."""


@dataclass
class ModelConfig:
    """The actor-critic network."""

    hidden_sizes: list[int] = field(default_factory=lambda: [64, 64])
    """Hidden layer widths of the MLP torso."""
    activation: str = "tanh"
    """Activation: tanh, relu, elu, gelu or silu."""
    shared_torso: bool = False
    """One torso for policy and value (``true``) or two separate ones."""
    encoder: str = "mlp"
    """Torso: ``mlp`` (vectors), ``nature_cnn`` or ``impala_resnet`` (uint8 images [C, H, W]),
    ``minatar_cnn`` (small images such as MinAtar's 10x10)."""
    core: str = "none"
    """``none`` or ``lstm``: an LSTM between torso and heads (needs ``shared_torso=true``);
    each rollout stores its initial state and the state resets at episode starts."""
    lstm_hidden_size: int = 256
    """Hidden units of the LSTM core."""
    use_last_action_reward: bool = False
    """Feed the previous action (one-hot) and reward (clipped to [-1, 1]) to the heads (or the
    core) next to the torso's features; both are zero at an episode start."""
    precision: str = "fp32"
    """``fp32`` or ``bf16``: bf16 autocast for the torso and core when acting and learning
    (weights, heads and losses stay float32)."""
    channels_last: bool = False
    """Channels-last memory format for the CNN encoders' convolutions (ignored by ``mlp``)."""
    shared_policy: bool = False
    """Structured envs: one policy network for every step key (their spaces must be equal)
    instead of one per step key."""
    critic: str = "per_step_key"
    """Structured envs: ``per_step_key`` (a critic per step key) or ``shared`` (one critic over
    every sub-step's observation, padded, with a one-hot step key)."""


@dataclass
class RunnerConfig:
    """Where the actors run."""

    backend: str = "subprocess"
    """``sequential`` (in-process, deterministic), ``subprocess`` (shared memory, fast) or
    ``ray`` (clusters)."""
    start_method: str = "forkserver"
    """How actor processes start: ``forkserver`` or ``spawn`` (safe), ``fork`` (only when the
    learner process has no threads yet)."""
    max_actor_restarts: int = 3
    """Actors that die (processes, Ray actors, or all Ray actors of a lost node) are restarted
    up to this many times in a run, then training stops with an error."""
    learner_threads: int | None = None
    """Torch intra-op threads of the learner process (``null``: the cores not used by actor
    processes, at least 1). Small models learn fastest with 1."""
    shutdown_timeout_s: float = 10.0
    """Seconds to wait for actors to stop before they are terminated, then killed."""
    ray_address: str | None = None
    """Ray backend: ``null`` starts a local Ray for the run (dashboard off, bound to this
    machine) and stops it at the end; ``auto`` or ``host:port`` joins a running cluster."""
    ray_num_cpus_per_actor: float = 1.0
    """Ray backend: CPUs each actor reserves (may be fractional)."""
    ray_num_gpus_per_actor: float = 0.0
    """Ray backend: GPUs each actor reserves (may be fractional)."""
    ray_resources_per_actor: dict[str, float] = field(default_factory=dict)
    """Ray backend: custom resources each actor reserves, e.g. ``{actor_node: 1}`` to place
    actors only on nodes started with ``--resources='{"actor_node": N}'``."""
    ray_include_dashboard: bool = False
    """Ray backend: start the Ray dashboard (on 127.0.0.1) with a local Ray."""


@dataclass
class LogConfig:
    """Where statistics go."""

    run_dir: str | None = None
    """Run directory (``null``: ``runs/<env>-<timestamp>``)."""
    console: bool = True
    """Live progress bar and a table per epoch on the console."""
    tensorboard: bool = True
    """Write TensorBoard event files into the run directory."""
    jsonl: bool = True
    """Write ``metrics.jsonl`` (one line per epoch) into the run directory."""
    checkpoint_every_epochs: int = 1
    """Write ``checkpoints/last.pt`` every this many epochs."""
    wandb: bool = False
    """Also log every epoch's statistics to Weights & Biases (needs ``pip install wandb``)."""
    wandb_project: str = "impala-rl"
    """The Weights & Biases project the run is logged to when ``wandb`` is true."""


@dataclass
class RunConfig:
    """A whole training run."""

    seed: int = 0
    """Seeds torch, numpy, the actors' samplers and the environments."""
    target_return: float | None = None
    """Stop when the evaluation mean return reaches this (``null``: never)."""
    max_env_steps: int | None = None
    """Stop after this many env steps (``null``: no limit)."""
    max_wall_time_s: float | None = None
    """Stop after this many seconds of training (``null``: no limit)."""
    algorithm: ImpalaAlgorithmConfig = field(default_factory=ImpalaAlgorithmConfig)
    """IMPALA hyper-parameters."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """The environment to train on."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The actor-critic network."""
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    """Where the actors run."""
    log: LogConfig = field(default_factory=LogConfig)
    """Where statistics and checkpoints go."""


def did_you_mean(name: str, valid: list[str] | tuple[str, ...]) -> str:
    """`` (did you mean 'x'?)`` for the valid name closest to a mistyped one, else ``""``."""
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def list_presets() -> list[str]:
    """Names of the shipped presets (``configs/<name>.yaml``)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def _preset_path(preset: str) -> Path:
    path = Path(preset)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        return path
    candidate = PRESETS_DIR / f"{preset}.yaml"
    if not candidate.is_file():
        raise ConfigError(
            f"unknown preset {preset!r}{did_you_mean(preset, list_presets())}: valid presets "
            f"are {', '.join(list_presets())}, or give a path to a YAML file"
        )
    return candidate


def _omegaconf_message(exc: OmegaConfBaseException, key_hint: str | None = None) -> str:
    key = getattr(exc, "full_key", None) or getattr(exc, "key", None) or key_hint
    msg = getattr(exc, "msg", None) or str(exc).splitlines()[0]
    msg = msg.splitlines()[0]
    if "Key" in msg and "not in" in msg:
        section = key.rsplit(".", 1)[0] if key and "." in key else None
        valid = _field_names(section)
        hint = did_you_mean(key.rsplit(".", 1)[-1], valid) if key else ""
        return f"unknown config key {key!r}{hint}; valid keys here are: {', '.join(valid)}"
    if key:
        return f"invalid value for {key!r}: {msg}"
    return msg


def _field_names(section: str | None) -> list[str]:
    cls: Any = RunConfig
    if section:
        for part in section.split("."):
            types = {f.name: f.type for f in dataclasses.fields(cls)}
            sub = getattr(cls(), part, None)
            if part not in types or not dataclasses.is_dataclass(sub):
                return []
            cls = type(sub)
    return [f.name for f in dataclasses.fields(cls)]


def load_config(
    preset: str | Path | None = None,
    overrides: list[str] | None = None,
    base: dict | DictConfig | None = None,
) -> RunConfig:
    """Build a validated :class:`RunConfig` from a preset name or YAML path plus overrides.

    ``overrides`` are ``section.key=value`` strings (OmegaConf dotlist syntax, values parsed as
    YAML). ``base`` (a dict, e.g. a saved resolved config) replaces the preset.
    """
    merged: Any = OmegaConf.structured(RunConfig)
    layers: list[tuple[Any, str | None]] = []
    if base is not None:
        layers.append((OmegaConf.create(base) if isinstance(base, dict) else base, None))
    if preset is not None:
        path = _preset_path(str(preset))
        try:
            layers.append((OmegaConf.load(path), None))
        except Exception as exc:  # YAML syntax errors
            raise ConfigError(f"cannot read config file {str(path)!r}: {exc}") from None
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(
                f"override {item!r} is not of the form section.key=value (e.g. algorithm.lr=3e-4)"
            )
        try:
            layers.append((OmegaConf.from_dotlist([item]), item.split("=", 1)[0]))
        except OmegaConfBaseException as exc:
            raise ConfigError(f"cannot parse override {item!r}: {exc}") from None
    try:
        for layer, key_hint in layers:
            try:
                merged = OmegaConf.merge(merged, layer)
            except OmegaConfBaseException as exc:
                raise ConfigError(_omegaconf_message(exc, key_hint)) from None
        cfg: RunConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise ConfigError(_omegaconf_message(exc)) from None
    validate(cfg)
    return cfg


def config_from_dict(data: dict) -> RunConfig:
    """Rebuild a validated config from :func:`to_dict`'s output (e.g. a checkpoint)."""
    return load_config(base=data)


def to_dict(cfg: RunConfig) -> dict:
    """Plain-container form of a config (YAML/JSON-serialisable)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _check(cond: bool, key: str, valid: str, value: Any) -> None:
    if not cond:
        raise ConfigError(f"invalid value for {key!r}: {value!r}; valid: {valid}")


def _is_host_port(address: str) -> bool:
    """``host:port`` (optionally ``ray://host:port``, Ray Client) with a numeric port."""
    if address.startswith("ray://"):
        address = address[len("ray://") :]
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def validate(cfg: RunConfig) -> None:
    """Range and choice checks the schema's types cannot express."""
    a = cfg.algorithm
    _check(a.epoch_length >= 1, "algorithm.epoch_length", "an integer >= 1", a.epoch_length)
    _check(
        a.n_rollout_steps >= 1, "algorithm.n_rollout_steps", "an integer >= 1", a.n_rollout_steps
    )
    _check(a.lr > 0, "algorithm.lr", "a number > 0", a.lr)
    _check(a.lr_final >= 0, "algorithm.lr_final", "a number >= 0", a.lr_final)
    _check(
        a.lr_schedule in LR_SCHEDULES,
        "algorithm.lr_schedule",
        " | ".join(LR_SCHEDULES),
        a.lr_schedule,
    )
    if a.lr_schedule == "linear":
        _check(
            a.lr_decay_env_steps is not None or cfg.max_env_steps is not None,
            "algorithm.lr_decay_env_steps",
            "an integer >= 1 (or set max_env_steps) when lr_schedule is linear",
            a.lr_decay_env_steps,
        )
    if a.lr_decay_env_steps is not None:
        _check(
            a.lr_decay_env_steps >= 1,
            "algorithm.lr_decay_env_steps",
            "an integer >= 1",
            a.lr_decay_env_steps,
        )
    _check(0.0 <= a.gamma <= 1.0, "algorithm.gamma", "a number in [0, 1]", a.gamma)
    for name in ("policy_loss_coef", "value_loss_coef", "entropy_coef"):
        value = getattr(a, name)
        _check(value >= 0, f"algorithm.{name}", "a number >= 0", value)
    if a.max_grad_norm is not None:
        _check(
            a.max_grad_norm >= 0,
            "algorithm.max_grad_norm",
            "a number >= 0 or null",
            a.max_grad_norm,
        )
    _check(a.optimizer in OPTIMIZERS, "algorithm.optimizer", " | ".join(OPTIMIZERS), a.optimizer)
    _check(
        len(a.adam_betas) == 2 and all(0 <= b < 1 for b in a.adam_betas),
        "algorithm.adam_betas",
        "two numbers in [0, 1)",
        a.adam_betas,
    )
    _check(
        0 <= a.rmsprop_alpha < 1, "algorithm.rmsprop_alpha", "a number in [0, 1)", a.rmsprop_alpha
    )
    _check(
        a.rmsprop_momentum >= 0, "algorithm.rmsprop_momentum", "a number >= 0", a.rmsprop_momentum
    )
    _check(a.optimizer_eps > 0, "algorithm.optimizer_eps", "a number > 0", a.optimizer_eps)
    _check(
        a.device == "auto" or a.device == "cpu" or a.device.startswith("cuda") or a.device == "mps",
        "algorithm.device",
        "cpu | cuda | cuda:N | mps | auto",
        a.device,
    )
    _check(
        a.queue_out_of_sync_factor > 0,
        "algorithm.queue_out_of_sync_factor",
        "a number > 0",
        a.queue_out_of_sync_factor,
    )
    _check(a.num_actors >= 1, "algorithm.num_actors", "an integer >= 1", a.num_actors)
    _check(
        a.actors_batch_size >= 1,
        "algorithm.actors_batch_size",
        "an integer >= 1",
        a.actors_batch_size,
    )
    _check(a.envs_per_actor >= 1, "algorithm.envs_per_actor", "an integer >= 1", a.envs_per_actor)
    for name in (
        "vtrace_clip_rho_threshold",
        "vtrace_clip_pg_rho_threshold",
        "vtrace_clip_c_threshold",
    ):
        value = getattr(a, name)
        if value is not None:
            _check(value > 0, f"algorithm.{name}", "a number > 0 or null", value)
    _check(
        0.0 <= a.vtrace_lambda <= 1.0,
        "algorithm.vtrace_lambda",
        "a number in [0, 1]",
        a.vtrace_lambda,
    )
    _check(
        a.reward_clipping in REWARD_CLIPPING_MODES,
        "algorithm.reward_clipping",
        " | ".join(REWARD_CLIPPING_MODES),
        a.reward_clipping,
    )
    if a.max_policy_lag is not None:
        _check(
            a.max_policy_lag >= 0,
            "algorithm.max_policy_lag",
            "an integer >= 0 or null",
            a.max_policy_lag,
        )
    _check(
        a.critic_burn_in_epochs >= 0,
        "algorithm.critic_burn_in_epochs",
        "an integer >= 0",
        a.critic_burn_in_epochs,
    )
    ev = a.rollout_evaluator
    _check(
        ev.n_episodes >= 1,
        "algorithm.rollout_evaluator.n_episodes",
        "an integer >= 1",
        ev.n_episodes,
    )
    if ev.max_episode_steps is not None:
        _check(
            ev.max_episode_steps >= 1,
            "algorithm.rollout_evaluator.max_episode_steps",
            "an integer >= 1 or null",
            ev.max_episode_steps,
        )

    _check(bool(cfg.env.id), "env.id", "a Gymnasium id or module:callable", cfg.env.id)
    _check(cfg.env.vector in VECTOR_ENVS, "env.vector", " | ".join(VECTOR_ENVS), cfg.env.vector)
    if cfg.env.max_episode_steps is not None:
        _check(
            cfg.env.max_episode_steps >= 1,
            "env.max_episode_steps",
            "an integer >= 1 or null",
            cfg.env.max_episode_steps,
        )
    m = cfg.model
    _check(
        len(m.hidden_sizes) >= 1 and all(h >= 1 for h in m.hidden_sizes),
        "model.hidden_sizes",
        "a non-empty list of integers >= 1",
        m.hidden_sizes,
    )
    _check(m.activation in ACTIVATIONS, "model.activation", " | ".join(ACTIVATIONS), m.activation)
    _check(m.encoder in ENCODERS, "model.encoder", " | ".join(ENCODERS), m.encoder)
    _check(m.core in CORES, "model.core", " | ".join(CORES), m.core)
    _check(m.lstm_hidden_size >= 1, "model.lstm_hidden_size", "an integer >= 1", m.lstm_hidden_size)
    if m.core != "none":
        _check(
            m.shared_torso,
            "model.shared_torso",
            f"true when model.core={m.core} (one torso feeds the core)",
            m.shared_torso,
        )
    _check(m.precision in PRECISIONS, "model.precision", " | ".join(PRECISIONS), m.precision)
    _check(m.critic in CRITIC_MODES, "model.critic", " | ".join(CRITIC_MODES), m.critic)
    _check(
        cfg.runner.backend in BACKENDS, "runner.backend", " | ".join(BACKENDS), cfg.runner.backend
    )
    r = cfg.runner
    _check(
        r.start_method in START_METHODS,
        "runner.start_method",
        " | ".join(START_METHODS),
        r.start_method,
    )
    _check(
        r.max_actor_restarts >= 0,
        "runner.max_actor_restarts",
        "an integer >= 0",
        r.max_actor_restarts,
    )
    if r.learner_threads is not None:
        _check(
            r.learner_threads >= 1,
            "runner.learner_threads",
            "an integer >= 1 or null",
            r.learner_threads,
        )
    _check(
        r.shutdown_timeout_s > 0, "runner.shutdown_timeout_s", "a number > 0", r.shutdown_timeout_s
    )
    if r.ray_address is not None:
        _check(
            r.ray_address == "auto" or _is_host_port(r.ray_address),
            "runner.ray_address",
            "null (start a local Ray), auto, or host:port of a running cluster",
            r.ray_address,
        )
    for name in ("ray_num_cpus_per_actor", "ray_num_gpus_per_actor"):
        value = getattr(r, name)
        _check(value >= 0, f"runner.{name}", "a number >= 0", value)
    for key, value in r.ray_resources_per_actor.items():
        _check(
            bool(key) and value > 0,
            f"runner.ray_resources_per_actor.{key}",
            "a resource name mapped to a number > 0",
            value,
        )
    _check(
        cfg.log.checkpoint_every_epochs >= 1,
        "log.checkpoint_every_epochs",
        "an integer >= 1",
        cfg.log.checkpoint_every_epochs,
    )
    if cfg.max_env_steps is not None:
        _check(
            cfg.max_env_steps >= 1, "max_env_steps", "an integer >= 1 or null", cfg.max_env_steps
        )
    if cfg.max_wall_time_s is not None:
        _check(
            cfg.max_wall_time_s > 0, "max_wall_time_s", "a number > 0 or null", cfg.max_wall_time_s
        )
