"""Typed run configuration: dataclasses, YAML presets, ``key=value`` overrides, validation.

The run config has top-level keys (``seed`` and the stop conditions) and one section per
concern: ``algorithm`` (:class:`ImpalaAlgorithmConfig`, the field names Maze-RL users know),
``env``, ``model``, ``runner`` and ``log``. OmegaConf merges presets and overrides against the
dataclass schema, which refuses unknown keys and wrong types; :func:`validate` then checks
the ranges and choices declared once in :data:`RULES` (and the few rules relating two
fields). Every error is a :class:`ConfigError` naming the field and what is valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

log = logging.getLogger(__name__)

PRESETS_DIR = Path(__file__).parent / "configs"

REWARD_CLIPPING_MODES = ("none", "abs_one", "soft_asymmetric")
OPTIMIZERS = ("adam", "rmsprop")
SCHEDULES = ("constant", "linear")
BACKENDS = ("sequential", "subprocess", "ray")
START_METHODS = ("forkserver", "spawn", "fork")
INFERENCE_PLACES = ("actor", "central", "learner")
ACTIVATIONS = ("tanh", "relu", "elu", "gelu", "silu")
ENCODERS = ("auto", "mlp", "nature_cnn", "impala_resnet", "minatar_cnn")
VECTOR_ENCODERS = ("auto", "mlp")
"""The encoders whose torso for vectors is the MLP of ``hidden_sizes`` (``auto``: an image's
is the CNN that fits it)."""
CORES = ("none", "lstm")
INITS = ("builtin", "orthogonal", "torch")
PRECISIONS = ("fp32", "bf16")
CRITIC_MODES = ("per_step_key", "shared")
VECTOR_ENVS = ("auto", "python", "envpool", "async")
POLICY_LOSSES = ("impala", "appo")
MINIBATCH_OF = ("columns", "steps")
STEP_TARGETS_PER = ("pass", "batch")
BACKGROUND_EVALUATION = ("thread", "process")  # and true (a thread) or false (in the pause)
ADV_MODES = ("official", "acme")  # vtrace.ADV_MODES
FLOAT_IMAGE_BOUNDS = ("finite", "unit")  # envs.images.FLOAT_IMAGE_BOUNDS


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
    background: bool | str = False
    """Evaluate a snapshot of the epoch's weights while training goes on (one evaluation at a
    time: an epoch that ends while one runs is not evaluated): ``thread`` (or ``true``) in a
    thread of the learner's process, on the learner's device; ``process`` in a process of its
    own on the CPU (one thread; the learner's Python is not shared, so it suits a core the
    learner leaves idle, e.g. the sequential backend's second). Best-model selection, patience
    and ``target_return`` act on each result when it arrives, with the snapshot's weights and
    epoch; ``false``: evaluate at the end of every epoch, training paused."""
    max_time_share: float | None = None
    """Evaluate at an epoch's end only while the time spent evaluating (the pause, or the
    background thread's) plus the last evaluation's length stays within this share of the wall
    time since the run (re)started, e.g. ``0.1`` (what ``env.id=ID`` without a preset gets); a
    run that ends on its budget or ``n_epochs`` still evaluates its final weights. ``null``:
    every epoch."""


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
    """Weight of the entropy bonus (the schedule's initial value)."""
    entropy_schedule: str = "constant"
    """``constant`` or ``linear`` (decays to ``entropy_coef_final`` over
    ``entropy_decay_env_steps``): a high bonus while the value function is still noise, a low
    one once the policy has found what pays."""
    entropy_coef_final: float = 0.0
    """Final entropy weight of the linear schedule."""
    entropy_decay_env_steps: int | None = None
    """Env steps over which the linear entropy schedule decays (``null``: ``max_env_steps``)."""
    entropy_floor: float | None = None
    """Nats of entropy each decision's policy keeps: below it, a penalty
    ``entropy_floor_coef * (entropy_floor - H)`` (nothing above it) pulls that decision back
    from determinism. A policy that has become deterministic gets no gradient from its
    advantages (``d log pi = 0`` at ``pi = 1``), so a late change of its greedy action is
    never undone (MiniGrid's LavaGap falling into the lava after solving it). Unlike
    ``entropy_coef``, it leaves a policy above the floor alone. ``null``: no floor."""
    entropy_floor_coef: float = 1.0
    """Weight of the entropy floor's penalty."""
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
    rmsprop_initial_square_avg: float = 0.0
    """RMSProp's mean square at the start. PyTorch starts it at 0, so the first steps are up
    to ~10x the learning rate; TensorFlow's RMSProp (the paper's) starts it at 1 on a loss
    summed over the batch, which is ``1 / (T * B)**2`` on our mean loss."""
    lr_warmup_env_steps: int = 0
    """The learning rate rises linearly from 0 to its scheduled value over this many env
    steps (0: no warm-up)."""
    device: str = "cpu"
    """Learner device: ``cpu``, ``cuda``, ``cuda:N``, ``mps`` (Apple silicon) or ``auto``
    (cuda when available)."""
    cuda_graph: bool = True
    """On a GPU, capture the update's forward, V-trace, losses, backward, clipping and
    optimizer step as one CUDA graph per batch shape (one launch instead of hundreds; a step
    whose loss or gradient norm the host then reads as not finite is undone), where the run
    allows it: one step key, no PopArt, one learner, fp32, not in burn-in. ``false``: always
    eager."""
    compile_update: bool | None = False
    """On a CPU, compile the update's forward, V-trace, losses, backward and clipping with
    ``torch.compile`` (inductor): one fused program per batch shape instead of hundreds of
    small ops, the same update up to float rounding. A small MLP's step is mostly that
    per-op overhead (2-4x faster compiled), a CNN's much less; the compile takes ~20-30 s at
    the first update. ``true``: compile where the run allows it (a CPU learner, one step key,
    no LSTM core, one learner, fp32, not in burn-in; elsewhere a warning says why it runs
    eagerly; an update that cannot be one program, e.g. an encoder of yours that reads a
    number back to the host, runs eagerly too and says so at the first update); ``null`` (the
    ``any_env`` preset's):
    that, for a model without convolutions over images longer than 16 pixels a side (an MLP,
    a grid world's small CNN) over a run of at least 10,000 optimizer steps (a shorter run does
    not win the compile back); ``false``: always eager."""
    queue_out_of_sync_factor: float = 1.0
    """At most ``factor * actors_batch_size`` finished rollouts wait for the learner."""
    broadcast_every: int | None = 1
    """Optimizer steps between two weight broadcasts to the actors (or inference servers)
    within a batch; a batch's last step always broadcasts, so ``null`` is once per batch.
    Fewer broadcasts copy the weights out less often (a GPU learner: a device-to-host copy
    each) and the actors act with weights up to that many steps older; versions count
    optimizer steps either way, so the policy lag V-trace and the events see stays exact."""
    actors_batch_size: int = 2
    """Rollouts (one per actor unroll) gathered into one learner batch."""
    num_actors: int = 2
    """Actors, each stepping a vector env of ``envs_per_actor`` environments (in all: with
    ``num_learners`` > 1 each learner gets ``num_actors / num_learners`` of them; a preset's
    count that the learners do not divide is raised to a multiple, its envs shared out)."""
    num_learners: int = 1
    """Data-parallel learner processes (rllte's and RLlib's name). Each takes batches of
    ``actors_batch_size`` unrolls from its own actors; gradients are averaged before every
    step, so all hold the same weights and a step sees ``num_learners * actors_batch_size``
    unrolls. One GPU each where there are enough (``device: cuda``), else shared."""
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
    adv_mode: str = "official"
    """The policy-gradient advantage's bootstrap (EvoRL's ``adv_mode``): ``official`` (the
    paper's, RLlib's) uses ``r_s + gamma v_{s+1} - V(x_s)``; ``acme`` (Acme's, rlax's) uses
    ``r_s + gamma (lambda v_{s+1} + (1 - lambda) V(x_{s+1})) - V(x_s)``, the same at lambda 1."""
    reward_clipping: str = "none"
    """``none``, ``abs_one`` (clip to [-1, 1]) or ``soft_asymmetric`` (the paper's tanh clip)."""
    max_policy_lag: int | None = None
    """Drop rollouts more than this many updates behind the learner (``null``: keep all); with
    ``num_passes`` > 1 the bound holds for every pass (at least ``num_passes - 1``)."""
    num_passes: int = 1
    """Optimizer steps per batch (sample reuse): each pass recomputes V-trace's importance
    weights against the current weights, which corrects the added off-policyness, and is
    broadcast to the actors."""
    num_minibatches: int = 1
    """Minibatches per pass: each pass splits the batch's columns (shuffled) into this many
    blocks, one optimizer step (and broadcast) each, so a batch takes ``num_passes *
    num_minibatches`` steps. It must divide the batch's columns (``actors_batch_size *
    envs_per_actor`` times the env's agents); V-trace runs along time within each column.
    With ``minibatch_of=steps`` it must divide the batch's decisions (its columns times
    ``n_rollout_steps``)."""
    minibatch_of: str = "columns"
    """What a minibatch draws from a batch: ``columns`` (whole columns, V-trace run on each
    minibatch with the weights of its step) or ``steps`` (single decisions drawn from the whole
    batch, as PPO's minibatches; V-trace's targets and advantages computed once per pass over
    the whole batch with that pass's first weights). ``steps`` decorrelates a minibatch's
    samples; it needs a model without a core (an LSTM trains on sequences): a preset's
    ``steps`` gives way to ``columns`` when the user sets ``model.core``."""
    step_targets: str = "pass"
    """With ``minibatch_of=steps``, when V-trace's targets, advantages and importance weights
    are computed: at each pass's start with that pass's weights (``pass``), or once per batch
    at its first pass and kept for the others (``batch``), as PPO computes its advantages once
    per rollout; ``batch`` saves a forward pass over the whole batch per further pass."""
    policy_loss: str = "impala"
    """``impala``: the policy gradient on V-trace advantages against the current weights.
    ``appo``: APPO / IMPACT (Luo et al. 2020): a target network (a copy of the model, not
    trained) gives V-trace's importance weights (``rho = pi_target / mu``), and the policy loss
    is PPO's clipped surrogate with the ratio ``pi / pi_target`` on V-trace's advantages, so
    passes and minibatches can reuse a batch safely. There is no KL penalty."""
    normalize_advantages: bool = False
    """Centre and scale the policy-gradient advantages of each optimizer step's batch (or
    minibatch) to mean 0 and standard deviation 1, as PPO implementations do."""
    clip_param: float = 0.4
    """``appo``: the surrogate's ratio is clipped to ``[1 - clip_param, 1 + clip_param]``
    (RLlib's APPO default 0.4)."""
    target_update_frequency: int | None = None
    """``appo``: optimizer steps between moves of the target network towards the trained one
    (``null``: once per batch, after its ``num_passes * num_minibatches`` steps, so every step
    on a batch is clipped against the policy that started it, as PPO's epochs)."""
    target_tau: float = 1.0
    """``appo``: how far each move goes, ``target <- tau * trained + (1 - tau) * target``
    (1.0: a hard copy)."""
    rollout_evaluator: RolloutEvaluatorConfig = field(default_factory=RolloutEvaluatorConfig)
    """Evaluation after every epoch."""


@dataclass
class EnvConfig:
    """What to train on."""

    id: str = "CartPole-v1"
    """A Gymnasium id (``MiniGrid-...``, ``MinAtar/...``, ``ALE/...`` and legacy
    ``PongNoFrameskip-v4`` ids are registered on demand, as are the ids of highway-env,
    flappy-bird-gymnasium, gymnasium-robotics, panda-gym and miniworld where installed; an id
    nobody registers names the package to install where its family is known), a PettingZoo
    env module (``pettingzoo.classic.connect_four_v3``, ``env.kwargs`` the arguments of
    ``impala_rl.envs.pettingzoo:make_aec_env``), ``package.module:callable`` returning a
    Gymnasium env, or Gymnasium's ``package:EnvId`` (the package is imported, which registers
    the id)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for ``gymnasium.make`` or the factory."""
    max_episode_steps: int | None = None
    """Time limit (truncation) on top of the env's own (``null``: the env's own)."""
    frame_stack: int = 1
    """Observations of the last this many steps, stacked (Gymnasium's
    ``FrameStackObservation``; zeros before an episode's first): for a pixel env whose single
    frames hide motion (CarRacing). Images stack as channels, vectors as one longer vector.
    ``1``: the observation alone."""
    vector: str = "python"
    """How an actor steps its envs: ``python`` (one after the other), ``async`` (each env in a
    process of its own, stepped at once: Gymnasium's ``AsyncVectorEnv``; the same episodes as
    ``python``, for envs whose step costs far more than passing it between processes, a
    millisecond or more; the sequential backend only; the evaluator's envs too),
    ``envpool`` (envpool's C++ vector env, classic control ids) or ``auto`` (times an actor's
    loop on both at start-up and takes the faster on this machine, for ids envpool has, when it
    is installed and ``kwargs`` is empty; else ``python``). The default stays ``python`` until
    envpool measures faster in whole training runs, not only raw stepping."""
    eval_kwargs: dict[str, Any] = field(default_factory=dict)
    """Entries that replace ``kwargs`` for the evaluation env (e.g. a fixed opponent)."""
    action_mask: bool = True
    """A plain env whose ``Dict`` observation has an ``action_mask`` entry (0/1 per action of
    a ``Discrete``, or per value of each ``MultiDiscrete`` dimension, concatenated; two per bit
    of a ``MultiBinary``, may it be 0 and may it be 1; for a ``Tuple`` or ``Dict`` action,
    those of its Discrete, MultiDiscrete and MultiBinary parts in the space's order, flat or as
    a ``Tuple``/``Dict`` of the parts' masks): the policy picks legal actions only, as in a
    structured env (the env is its one-key case, the mask not read as an input).
    ``false``: the entry is read as any other and nothing is masked (runs saved before this
    setting)."""
    info_action_mask: bool = True
    """A plain env with ``Discrete``, ``MultiDiscrete`` or ``MultiBinary`` actions (or parts)
    that gives its legal actions beside the observation, as ``info["action_mask"]`` at reset
    and every step (Gymnasium's Taxi) or as an ``action_masks()`` method (sb3-contrib's
    MaskablePPO convention), in the layout of ``action_mask``: the policy picks legal actions
    only, as with an ``action_mask`` entry (the first env built is reset once to look).
    ``false``: ignored (runs saved before this setting)."""
    observation_entries: bool = True
    """A ``Tuple`` observation that holds an image or a text, a ``Text`` observation alone,
    and a Tuple or Dict inside a Dict that holds one, reach the model as a Dict's entries do
    (a Tuple's keyed by position, ``"0"``, ``"1"``...; a text alone as ``"text"``; a nested
    one as ``"robot/camera"``): an image read by a CNN, a text as its words; a step key's
    observation and a native vector env's rows alike. ``false``: flattened to one float
    vector (an image's pixels, a text's character indices), as runs saved before this
    setting were."""
    max_image_side: int | None = 128
    """An image observation (plain, a Dict's or Tuple's entry, a step key's) whose longer side
    is longer than this many pixels is downscaled, keeping its aspect ratio, until that side
    is this long (a pixel the mean of the source pixels whose centres it covers;
    :mod:`impala_rl.envs.images`): a frame rendered at screen size (400x600 becomes 85x128)
    would give the Nature CNN ~10^8 weights. ``null``: images as the env gives them (runs
    saved before this setting)."""
    float_images: bool = True
    """A float ``Box`` shaped as an image (2-4 dimensions, at most 4 channels first or last, 8
    or more pixels a side) with finite bounds (a camera the env normalized to ``[0, 1]`` or
    ``[-1, 1]``) is read as an image: converted to the ``uint8`` image of the same pixels (its
    bounds stretched over 0-255) and read by a CNN. ``false``: flattened into the MLP's inputs
    (runs saved before this setting)."""
    float_image_bounds: str = "finite"
    """The bounds of a float image that ``env.float_images`` reads as one: ``finite``: any
    finite bounds, low below high; ``unit``: ``[0, 1]`` or ``[0, 255]`` throughout only (runs
    saved before other bounds were read; ``[-1, 1]`` then flattened)."""


@dataclass
class ModelConfig:
    """The actor-critic network."""

    hidden_sizes: list[int] = field(default_factory=lambda: [64, 64])
    """Hidden layer widths of the MLP torso."""
    activation: str = "tanh"
    """Activation: tanh, relu, elu, gelu or silu."""
    shared_torso: bool = False
    """One torso for policy and value (``true``) or two separate ones."""
    encoder: str = "auto"
    """Torso: ``auto``, the one that fits the observation (an MLP for vectors; for a ``uint8``
    image [C, H, W] the Nature CNN from 36 pixels a side, the MinAtar CNN below, an MLP under
    3 pixels; an encoder per entry of a Dict, and per step key); ``mlp`` (vectors; an image
    flattened, as runs saved before ``auto`` were built), ``nature_cnn`` or ``impala_resnet``
    (uint8 images [C, H, W]), ``minatar_cnn`` (small images such as MinAtar's 10x10), or your
    own by import path,
    ``package.module:Class``: built as ``Class(observation_space, **encoder_kwargs)``, an
    ``nn.Module`` with an int ``out_features`` that maps observations ``[N, *obs_shape]`` (in
    the space's dtype: images stay uint8) to features ``[N, out_features]``. The heads, core,
    last inputs, PopArt, bf16 and central inference work on top of it as on a built-in one.
    A Dict observation gets an encoder per entry, features concatenated: the CNN that fits an
    image (the one named here, if any), a one-hot for a Discrete entry, and for its vectors
    and text (``read_text``) the MLP (``hidden_sizes``) of ``dict_vectors``; an encoder by
    import path gets the whole Dict (``{entry: [N, *o_entry]}``)."""
    dict_vectors: str = "joint"
    """A Dict observation's vector entries: ``joint``, concatenated into one MLP, so features
    can combine entries (a goal's offset from a position; SB3's ``CombinedExtractor`` and
    RLlib read a Dict so); ``per_entry``, an MLP each, their features only added up by the
    heads (runs saved before this setting existed)."""
    read_text: bool = True
    """Whether the torsos read a Dict observation's text entries (``Text``, MiniGrid's
    mission): its first 32 words, lower case, each as two hashed ids, embedded by position
    (``impala_rl.envs.spaces.TextTokens``; an encoder by import path gets the ids
    ``[N, 32, 2]``). ``false``: left out, as runs saved before this setting were built."""
    encoder_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of an encoder given by import path (recorded with the run, so resume,
    ``impala eval`` and ``load_policy`` rebuild it); empty for a built-in encoder."""
    value_encoder: str | None = None
    """The value torso's encoder when the torso is not shared: a built-in name or
    ``package.module:Class`` as ``encoder``; ``null``: the same as ``encoder`` (with
    ``encoder_kwargs``)."""
    value_encoder_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of a ``value_encoder`` given by import path."""
    policy_obs_keys: list[str] | None = None
    """Dict observations: the entries the policy's torso reads (a shared torso's, too);
    ``null``: every entry. EvoRL's ``policy_obs_key``."""
    value_obs_keys: list[str] | None = None
    """Dict observations: the entries the value torso reads (``shared_torso: false``);
    ``null``: every entry. A privileged critic reads entries the policy does not."""
    core: str = "none"
    """``none`` or ``lstm``: an LSTM between torso and heads (one torso feeds it:
    ``shared_torso`` becomes true unless set); each rollout stores its initial state and the
    state resets at episode starts."""
    lstm_hidden_size: int = 256
    """Hidden units of the LSTM core."""
    use_last_action_reward: bool = False
    """Feed the previous action (one-hot) and reward (clipped to [-1, 1]) to the heads (or the
    core) next to the torso's features; both are zero at an episode start."""
    precision: str = "fp32"
    """``fp32`` or ``bf16``: bf16 autocast for the torso and core when acting and learning
    (weights, heads and losses stay float32; the LSTM core stays fp32 on a CPU without
    AVX-512, whose oneDNN has no bf16 LSTM)."""
    channels_last: bool = False
    """Channels-last memory format for the CNN encoders' convolutions (ignored by an MLP)."""
    shared_policy: bool = False
    """Structured envs: one policy network for every step key (their spaces must be equal)
    instead of one per step key."""
    critic: str = "per_step_key"
    """Structured envs: ``per_step_key`` (a critic per step key) or ``shared`` (one critic over
    every sub-step's observation, padded, with a one-hot step key)."""
    actor_hidden_sizes: list[int] | None = None
    """The policy torso's hidden widths when the torso is not shared (``auto`` or ``mlp``
    encoder, on vectors); ``null``: ``hidden_sizes``."""
    critic_hidden_sizes: list[int] | None = None
    """The value torso's hidden widths when the torso is not shared (``auto`` or ``mlp``
    encoder, on vectors); ``null``: ``hidden_sizes``."""
    init: str = "builtin"
    """Weight init: ``builtin`` (each layer's own: orthogonal for MLPs, the Nature CNN, the
    LSTM and the heads, PyTorch's for the ResNet and MinAtar convolutions), ``orthogonal``
    (every layer; gain sqrt(2) hidden, 0.01 policy output, 1 value head; zero biases) or
    ``torch`` (PyTorch's defaults)."""
    normalize_obs: bool = False
    """Normalize vector observations by their running mean and variance (clipped to +-10):
    updated by the learner from every training batch, kept in the model's state (actors,
    checkpoints, evaluation and ``load_policy`` use it); per step key on structured envs, per
    vector entry of a Dict observation. ``auto`` or ``mlp`` encoder; under ``auto`` an image
    is left to its CNN (scaled to [0, 1]), so only the vectors are normalized."""
    normalize_obs_center: bool = True
    """``normalize_obs``: ``true`` subtracts the running mean and divides by the standard
    deviation; ``false`` only divides by the running root mean square (``sqrt(mean² + var)``),
    so each entry keeps its offset. For readings whose resting value carries the information,
    such as lidar distances: FlappyBird's lidar learns so and stalls centered
    (docs/experiments/any-env.md)."""
    popart: bool = False
    """PopArt value normalization: the value head learns normalized targets while its outputs
    stay on the reward's scale (statistics of the V-trace targets, outputs preserved at each
    update); policy-gradient advantages are divided by the same scale. Structured envs: one
    PopArt head per critic."""
    popart_beta: float = 3.0e-4
    """Step size of PopArt's running moments of the V-trace targets."""
    popart_sigma_min: float = 1.0e-4
    """The least scale PopArt divides by: targets of a narrower spread are learned on their own
    scale (divided by this), as an unnormalized critic learns them. ``1.0``: only returns that
    spread wider than a freshly initialised value head's outputs are normalized."""


@dataclass
class RunnerConfig:
    """Where the actors run."""

    backend: str = "subprocess"
    """``sequential`` (in-process, deterministic), ``subprocess`` (shared memory, fast) or
    ``ray`` (clusters)."""
    inference: str = "actor"
    """Where the policy acts: ``actor`` (each actor process runs its own copy, loaded between
    unrolls) or ``central`` (actor processes only step envs; a server process batches every
    waiting actor's observations and acts on ``algorithm.device``: for a GPU box; subprocess
    backend only) or ``learner`` (central, the server a thread of the learner's process: one
    CUDA context on the GPU, the weights copied there at each broadcast; one server)."""
    inference_servers: int = 1
    """``runner.inference=central``: server processes (Sample Factory's policy workers), actor
    ``i`` served by server ``i % inference_servers`` (with ``env_splits=K``, its group ``g`` by
    server ``(i * K + g) % inference_servers``); with several learners, each learner runs this
    many for its own actors (at most their env groups). One server's Python work per
    batch caps the actors it can serve; add one when its closing log line says it was busy
    most of the time and the device has room."""
    env_splits: int = 1
    """``runner.inference=central`` or ``learner``: each actor's ``algorithm.envs_per_actor``
    envs in this many groups that take turns, each in a thread of the actor process with its
    own request to the server, so one group steps while the others' requests are served
    (Sample Factory's double-buffered sampling). 1: all of an actor's envs step, then wait,
    together. Must divide ``algorithm.envs_per_actor``."""
    size_to_machine: bool = False
    """Size the preset to the machine at start-up (:mod:`impala_rl.sizing`): actors from the
    cores, the learner and central inference on a GPU, the batch to match, and minibatches and
    epoch that keep the preset's optimizer steps and env steps per epoch (minibatches no more
    than ``max_policy_lag`` allows) and its weight broadcasts per batch; settings given as
    overrides stay; precision is never sized. 2 cores: the preset as written. The rules
    between fields are checked on the sized config: ``runner.env_splits=4`` alone is valid on
    a GPU box, whose sizing makes inference central."""
    sized_for: str | None = None
    """The machine a sized run was sized for (set at start-up; a resume keeps the sizes)."""
    start_method: str = "forkserver"
    """How actor processes start: ``forkserver`` or ``spawn`` (safe), ``fork`` (only when the
    learner process has no threads yet)."""
    max_actor_restarts: int = 3
    """Actors that die (processes, Ray actors, or all Ray actors of a lost node) are restarted
    up to this many times in a run, then training stops with an error. One that dies again
    before it came up is restarted after a back-off (0.5 s, doubling, at most 30 s)."""
    learner_threads: int | None = None
    """Torch intra-op threads of the learner process (``null``: the cores this process may
    use, as ``taskset`` allows, less those of actor processes, at least 1). Small models learn
    fastest with 1."""
    keep_freed_memory: bool = True
    """Learner process on Linux/glibc: serve allocations up to 32 MB from the heap and keep
    freed memory instead of returning it to the OS, so each update does not page-fault its
    activations again (the `pong` learner's update: ~15-25% less time; RSS stays at its peak)."""
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
    ray_num_gpus_per_learner: float = 0.0
    """Ray backend with ``algorithm.num_learners`` > 1: GPUs each further learner (a Ray
    actor) reserves; learner 0 runs in the process that was started."""
    ray_num_cpus_per_learner: float = 1.0
    """Ray backend with ``algorithm.num_learners`` > 1: CPUs each further learner reserves."""
    ray_include_dashboard: bool = False
    """Ray backend: start the Ray dashboard (on 127.0.0.1) with a local Ray."""


@dataclass
class LogConfig:
    """Where statistics go."""

    run_dir: str | None = None
    """Run directory (``null``: ``runs/<env>-<timestamp>``)."""
    console: bool = True
    """Live progress bar and a table per epoch on the console."""
    console_stats: list[str] = field(default_factory=list)
    """Glob patterns of the statistics the console prints each epoch, e.g.
    ``[episode_return/mean, eval_return/mean, policy_entropy/*]`` (``[]``: the compact table's
    columns on a terminal, every statistic in a log that is not a terminal). The run
    directory's ``metrics.jsonl`` and TensorBoard files always hold every statistic."""
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


def _preset_layers(preset: str, seen: tuple[str, ...] = ()) -> list[Any]:
    """A preset's YAML, after the layers of the preset its ``base:`` key names (a family
    preset that changes a few settings of another)."""
    path = _preset_path(preset)
    try:
        layer = OmegaConf.load(path)
    except Exception as exc:  # YAML syntax errors
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc}") from None
    base = layer.pop("base", None) if isinstance(layer, DictConfig) else None
    if base is None:
        return [layer]
    if str(base) in seen or str(base) == preset:
        raise ConfigError(f"config file {str(path)!r}: base {base!r} refers back to itself")
    return [*_preset_layers(str(base), (*seen, preset)), layer]


def user_file_keys(preset: str | Path | None) -> set[str]:
    """The dotted keys a config file of the user's sets (``impala train --config FILE`` or a
    path as the preset), its own and those of other files of theirs it builds on (``base:``),
    not those of the shipped presets under them: what the user gave, as an override is."""
    keys: set[str] = set()
    seen: set[Path] = set()
    name = None if preset is None else str(preset)
    while name is not None:
        path = _preset_path(name).resolve()
        if path.parent == PRESETS_DIR.resolve() or path in seen:
            break
        seen.add(path)
        layer = OmegaConf.load(path)
        if not isinstance(layer, DictConfig):
            break
        base = layer.pop("base", None)
        keys |= set(flat_dict(OmegaConf.to_container(layer)))  # type: ignore[arg-type]
        name = None if base is None else str(base)
    return keys


def flat_dict(tree: dict, prefix: str = "") -> dict[str, Any]:
    """``{"section.key": value}`` for every leaf of a nested dict (an empty dict is a leaf; a
    dict under ``env.kwargs`` goes key by key)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flat_dict(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _preset_path(preset: str) -> Path:
    path = Path(preset)
    if path.suffix in (".yaml", ".yml") or path.is_file():
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
        rule = RULES.get(key)
        return f"invalid value for {key!r}: {msg}" + (f"; valid: {rule.valid}" if rule else "")
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
    sizing_follows: bool = False,
) -> RunConfig:
    """Build a validated :class:`RunConfig` from a preset name or YAML path plus overrides.

    ``overrides`` are ``section.key=value`` strings (OmegaConf dotlist syntax, values parsed as
    YAML). ``base`` (a dict, e.g. a saved resolved config) replaces the preset.
    ``sizing_follows``: the caller sizes the config next (``impala_rl.sizing``), which
    validates it whole; a config it will size gets each field's own rule here, and the rules
    between fields on the sized values (``runner.env_splits=2`` on a GPU box, where the
    sizing makes inference central).
    """
    cfg = merge_config(preset, overrides, base)
    given = _given_keys(preset, overrides, base)
    _share_actors_among_learners(cfg, given)
    if sizing_follows and cfg.runner.size_to_machine and cfg.runner.sized_for is None:
        check_rules(cfg)
    else:
        validate(cfg)
    _warn_inert(cfg, given)
    return cfg


def _share_actors_among_learners(cfg: RunConfig, given: set[str]) -> None:
    """A preset's actors made a multiple of ``algorithm.num_learners`` where they are not and
    the user gave no ``algorithm.num_actors``: each learner takes as many actors, which step the
    preset's envs between them where they divide (``any_env``'s one actor of 8 envs is 2 actors
    of 4 for 2 learners, a step on the same 1,024 env steps). A given actor count is refused
    as it is, naming the field."""
    a = cfg.algorithm
    if min(a.num_actors, a.num_learners) < 1 or "algorithm.num_actors" in given:
        return  # the ranges' refusals, or the user's count as given
    if a.num_actors % a.num_learners == 0:
        return
    actors = -(-a.num_actors // a.num_learners) * a.num_learners
    envs = a.num_actors * a.envs_per_actor
    before = f"{a.num_actors} x {a.envs_per_actor}"
    a.num_actors = actors
    if "algorithm.envs_per_actor" not in given and envs % actors == 0:
        shared = dataclasses.replace(a, envs_per_actor=envs // actors)
        try:  # each learner's batch still cut into the preset's minibatches
            check_num_minibatches(shared, shared.actors_batch_size * shared.envs_per_actor)
            fits = shared.envs_per_actor % cfg.runner.env_splits == 0
        except (ConfigError, ZeroDivisionError):  # a range refused by validate, naming it
            fits = False
        if fits:
            a.envs_per_actor = shared.envs_per_actor
    log.info(
        "algorithm.num_learners=%d: %d actors x %d envs, %d a learner, for the preset's "
        "%s (algorithm.num_actors sets them)",
        a.num_learners,
        a.num_actors,
        a.envs_per_actor,
        a.num_actors // a.num_learners,
        before,
    )


# A setting read only when another is on: (the setting, the switch it needs).
_NEEDS_SWITCH = (
    ("model.normalize_obs_center", "model.normalize_obs"),
    ("model.popart_beta", "model.popart"),
    ("model.popart_sigma_min", "model.popart"),
)


def _warn_inert(cfg: RunConfig, given: set[str]) -> None:
    """A warning for each setting the user changed that nothing reads, as its switch is off
    (``model.normalize_obs_center=false`` without ``model.normalize_obs``). Not an error, and
    not for a default value: a run's saved config, reused as a file, holds every key."""
    defaults = RunConfig()
    for key, switch in _NEEDS_SWITCH:
        changed = _get(cfg, key) != _get(defaults, key)
        if key in given and changed and not _get(cfg, switch):
            log.warning("%s has no effect: it applies only with %s=true", key, switch)


def _given_keys(
    preset: str | Path | None, overrides: list[str] | None, base: dict | DictConfig | None
) -> set[str]:
    """The dotted keys the user gave: overrides, their config files' keys and a ``base``'s
    algorithm keys (a search trial's settings)."""
    given = {item.split("=", 1)[0] for item in overrides or [] if "=" in item}
    given |= user_file_keys(preset)
    if base is not None:
        given |= {f"algorithm.{k}" for k in OmegaConf.create(base).get("algorithm", None) or {}}
    return given


def merge_config(
    preset: str | Path | None = None,
    overrides: list[str] | None = None,
    base: dict | DictConfig | None = None,
) -> RunConfig:
    """:func:`load_config` without :func:`validate`: the schema's keys and types checked, the
    ranges and the rules between fields not. For a caller that reads part of the overrides to
    choose the layers under them (``env.id`` picks a preset): the config that runs is
    validated once, whole, as ranges and cross-field rules depend on those layers."""
    merged: Any = OmegaConf.structured(RunConfig)
    layers: list[tuple[Any, str | None]] = []
    if base is not None:
        layers.append((OmegaConf.create(base) if isinstance(base, dict) else base, None))
    if preset is not None:
        layers += [(layer, None) for layer in _preset_layers(str(preset))]
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
    _fit_to_core(cfg, _given_keys(preset, overrides, base))
    return cfg


def _fit_to_core(cfg: RunConfig, given: set[str]) -> None:
    """A core the user asks for (``impala train minigrid model.core=lstm``) gets what it needs
    from the settings the user did not give: one torso that feeds it (``shared_torso``, where
    no value torso of its own is set) and minibatches of whole columns (the LSTM trains on
    sequences) instead of a preset's single decisions (``minibatch_of=steps``). Set by the user
    beside a core, ``shared_torso=false`` and ``steps`` are refused by :func:`validate`."""
    a, m = cfg.algorithm, cfg.model
    if m.core == "none":
        return
    if a.minibatch_of == "steps" and "algorithm.minibatch_of" not in given:
        a.minibatch_of = "columns"
    if (
        not m.shared_torso
        and "model.shared_torso" not in given
        and m.value_encoder is None
        and m.value_obs_keys is None
    ):
        m.shared_torso = True


def config_from_dict(data: dict) -> RunConfig:
    """Rebuild a validated config from :func:`to_dict`'s output (e.g. a checkpoint).

    A config saved before a setting existed gets the behaviour it was trained with:
    ``model.dict_vectors=per_entry``, ``model.read_text=false``, ``env.action_mask=false``,
    ``env.observation_entries=false``, ``env.max_image_side=null``, ``env.float_images=false``,
    ``env.info_action_mask=false``, ``env.float_image_bounds=unit``."""
    earlier = {
        "model": {"dict_vectors": "per_entry", "read_text": False},
        "env": {
            "action_mask": False,
            "observation_entries": False,
            "max_image_side": None,
            "float_images": False,
            "info_action_mask": False,
            "float_image_bounds": "unit",
        },
    }
    for section, settings in earlier.items():
        saved = data.get(section)
        if isinstance(saved, dict) and any(k not in saved for k in settings):
            missing = {k: v for k, v in settings.items() if k not in saved}
            data = {**data, section: {**missing, **saved}}
    return load_config(base=data)


def to_dict(cfg: RunConfig) -> dict:
    """Plain-container form of a config (YAML/JSON-serialisable)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _is_host_port(address: str) -> bool:
    """``host:port`` (optionally ``ray://host:port``, Ray Client) with a numeric port."""
    if address.startswith("ray://"):
        address = address[len("ray://") :]
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


class Rule(NamedTuple):
    """A declared constraint on one field: ``ok(value)``, and the text saying what is valid.
    ``nullable`` fields also accept ``null``."""

    ok: Callable[[Any], bool]
    valid: str
    nullable: bool = False


def is_import_path(value: Any) -> bool:
    """``package.module:Attribute`` (dotted names on both sides of one colon)."""
    name = r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*"
    return isinstance(value, str) and re.fullmatch(f"{name}:{name}", value) is not None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _kind(integer: bool) -> str:
    return "an integer" if integer else "a number"


def _or_null(text: str, nullable: bool) -> str:
    return f"{text} or null" if nullable else text


def at_least(bound: float, integer: bool = False, nullable: bool = False) -> Rule:
    text = _or_null(f"{_kind(integer)} >= {bound}", nullable)
    return Rule(lambda v: _number(v) and v >= bound, text, nullable)


def above(bound: float, nullable: bool = False) -> Rule:
    return Rule(
        lambda v: _number(v) and v > bound, _or_null(f"a number > {bound}", nullable), nullable
    )


def unit_interval(closed_above: bool = True) -> Rule:
    if closed_above:
        return Rule(lambda v: _number(v) and 0 <= v <= 1, "a number in [0, 1]")
    return Rule(lambda v: _number(v) and 0 <= v < 1, "a number in [0, 1)")


def one_of(choices: tuple[str, ...]) -> Rule:
    return Rule(lambda v: v in choices, " | ".join(choices))


def _device(value: str) -> bool:
    return value in ("auto", "cpu", "mps", "cuda") or re.fullmatch(r"cuda:\d+", value) is not None


# Every range and choice of the schema, by dotted key. The schema's types come first (OmegaConf
# refuses unknown keys and wrong types); these rules then run in this order.
RULES: dict[str, Rule] = {
    # numpy's legacy seed takes 32 bits; a negative one fails in np.random.SeedSequence
    "seed": Rule(
        lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32,
        "an integer in [0, 2**32)",
    ),
    "target_return": Rule(_number, "a finite number or null", nullable=True),
    "max_env_steps": at_least(1, integer=True, nullable=True),
    "max_wall_time_s": above(0, nullable=True),
    "algorithm.n_epochs": at_least(0, integer=True),
    "algorithm.patience": at_least(0, integer=True),
    "algorithm.epoch_length": at_least(1, integer=True),
    "algorithm.n_rollout_steps": at_least(1, integer=True),
    "algorithm.lr": above(0),
    "algorithm.lr_final": at_least(0),
    "algorithm.lr_schedule": one_of(SCHEDULES),
    "algorithm.lr_decay_env_steps": at_least(1, integer=True, nullable=True),
    "algorithm.gamma": unit_interval(),
    "algorithm.policy_loss_coef": at_least(0),
    "algorithm.value_loss_coef": at_least(0),
    "algorithm.entropy_coef": at_least(0),
    "algorithm.entropy_coef_final": at_least(0),
    "algorithm.entropy_schedule": one_of(SCHEDULES),
    "algorithm.entropy_decay_env_steps": at_least(1, integer=True, nullable=True),
    "algorithm.entropy_floor": Rule(_number, "a number (nats per decision)", nullable=True),
    "algorithm.entropy_floor_coef": at_least(0),
    "algorithm.max_grad_norm": at_least(0, nullable=True),
    "algorithm.optimizer": one_of(OPTIMIZERS),
    "algorithm.adam_betas": Rule(
        lambda v: len(v) == 2 and all(_number(b) and 0 <= b < 1 for b in v),
        "two numbers in [0, 1)",
    ),
    "algorithm.rmsprop_alpha": unit_interval(closed_above=False),
    "algorithm.rmsprop_momentum": at_least(0),
    "algorithm.optimizer_eps": above(0),
    "algorithm.rmsprop_initial_square_avg": at_least(0),
    "algorithm.lr_warmup_env_steps": at_least(0, integer=True),
    "algorithm.device": Rule(_device, "cpu | cuda | cuda:N | mps | auto"),
    # and against actors_batch_size in validate()
    "algorithm.queue_out_of_sync_factor": above(0),
    "algorithm.actors_batch_size": at_least(1, integer=True),
    "algorithm.num_actors": at_least(1, integer=True),
    "algorithm.envs_per_actor": at_least(1, integer=True),
    "algorithm.vtrace_clip_rho_threshold": above(0, nullable=True),
    "algorithm.vtrace_clip_pg_rho_threshold": above(0, nullable=True),
    "algorithm.vtrace_clip_c_threshold": above(0, nullable=True),
    "algorithm.vtrace_lambda": unit_interval(),
    "algorithm.adv_mode": one_of(ADV_MODES),
    "algorithm.reward_clipping": one_of(REWARD_CLIPPING_MODES),
    "algorithm.max_policy_lag": at_least(0, integer=True, nullable=True),
    "algorithm.broadcast_every": at_least(1, integer=True, nullable=True),
    "algorithm.num_passes": at_least(1, integer=True),
    "algorithm.num_learners": at_least(1, integer=True),
    "algorithm.num_minibatches": at_least(1, integer=True),
    "algorithm.minibatch_of": one_of(MINIBATCH_OF),
    "algorithm.step_targets": one_of(STEP_TARGETS_PER),
    "algorithm.policy_loss": one_of(POLICY_LOSSES),
    "algorithm.clip_param": above(0),
    "algorithm.target_update_frequency": at_least(1, integer=True, nullable=True),
    "algorithm.target_tau": Rule(lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "algorithm.critic_burn_in_epochs": at_least(0, integer=True),
    "algorithm.rollout_evaluator.n_episodes": at_least(1, integer=True),
    "algorithm.rollout_evaluator.max_episode_steps": at_least(1, integer=True, nullable=True),
    "algorithm.rollout_evaluator.background": Rule(
        lambda v: v is True or v is False or v in BACKGROUND_EVALUATION,
        "false | true | " + " | ".join(BACKGROUND_EVALUATION),
    ),
    "algorithm.rollout_evaluator.max_time_share": Rule(
        lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1] or null", nullable=True
    ),
    "env.id": Rule(bool, "a Gymnasium id, module:callable or module:EnvId"),
    "env.max_episode_steps": at_least(1, integer=True, nullable=True),
    "env.frame_stack": at_least(1, integer=True),
    "env.max_image_side": at_least(8, integer=True, nullable=True),
    "env.float_image_bounds": one_of(FLOAT_IMAGE_BOUNDS),
    "env.vector": one_of(VECTOR_ENVS),
    "model.hidden_sizes": Rule(
        lambda v: len(v) >= 1 and all(h >= 1 for h in v), "a non-empty list of integers >= 1"
    ),
    "model.activation": one_of(ACTIVATIONS),
    "model.encoder": Rule(
        lambda v: v in ENCODERS or is_import_path(v),
        " | ".join(ENCODERS) + " | package.module:Class (your own encoder)",
    ),
    "model.value_encoder": Rule(
        lambda v: v in ENCODERS or is_import_path(v),
        " | ".join(ENCODERS) + " | package.module:Class (your own encoder) | null",
        nullable=True,
    ),
    "model.policy_obs_keys": Rule(
        lambda v: len(v) >= 1 and all(isinstance(k, str) and k for k in v),
        "a non-empty list of a Dict observation's entries",
        nullable=True,
    ),
    "model.value_obs_keys": Rule(
        lambda v: len(v) >= 1 and all(isinstance(k, str) and k for k in v),
        "a non-empty list of a Dict observation's entries",
        nullable=True,
    ),
    "model.dict_vectors": one_of(("joint", "per_entry")),
    "model.core": one_of(CORES),
    "model.lstm_hidden_size": at_least(1, integer=True),
    "model.precision": one_of(PRECISIONS),
    "model.critic": one_of(CRITIC_MODES),
    "model.actor_hidden_sizes": Rule(
        lambda v: len(v) >= 1 and all(h >= 1 for h in v),
        "a non-empty list of integers >= 1",
        nullable=True,
    ),
    "model.critic_hidden_sizes": Rule(
        lambda v: len(v) >= 1 and all(h >= 1 for h in v),
        "a non-empty list of integers >= 1",
        nullable=True,
    ),
    "model.init": one_of(INITS),
    "model.popart_beta": Rule(lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "model.popart_sigma_min": Rule(
        lambda v: _number(v) and 0 < v < 1e6, "a number > 0 and under 1e6 (PopArt's largest scale)"
    ),
    "runner.backend": one_of(BACKENDS),
    "runner.start_method": one_of(START_METHODS),
    "runner.inference": one_of(INFERENCE_PLACES),
    "runner.inference_servers": at_least(1, integer=True),
    "runner.env_splits": at_least(1, integer=True),
    "runner.max_actor_restarts": at_least(0, integer=True),
    "runner.learner_threads": at_least(1, integer=True, nullable=True),
    "runner.shutdown_timeout_s": above(0),
    "runner.ray_address": Rule(
        lambda v: v == "auto" or _is_host_port(v),
        "null (start a local Ray), auto, or host:port of a running cluster",
        nullable=True,
    ),
    "runner.ray_num_cpus_per_actor": at_least(0),
    "runner.ray_num_gpus_per_actor": at_least(0),
    "runner.ray_num_gpus_per_learner": at_least(0),
    "runner.ray_num_cpus_per_learner": at_least(0),
    "log.checkpoint_every_epochs": at_least(1, integer=True),
    "log.run_dir": Rule(
        lambda v: bool(v.strip()) and not Path(v).expanduser().is_file(),
        "null or a directory path (not an existing file)",
        nullable=True,
    ),
    "log.wandb_project": Rule(lambda v: bool(v.strip()), "a non-empty project name"),
}


def _get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _refuse(key: str, valid: str, value: Any) -> None:
    raise ConfigError(f"invalid value for {key!r}: {value!r}; valid: {valid}")


def max_waiting_rollouts(a: ImpalaAlgorithmConfig) -> int:
    """How many finished rollouts may wait for the learner: ``ceil(factor * actors_batch_size)``.

    Every backend sizes its queue with this; :func:`validate` refuses a factor that makes it
    smaller than one batch.
    """
    factor = a.queue_out_of_sync_factor
    if not math.isfinite(factor) or factor <= 0:
        return 0
    return math.ceil(factor * a.actors_batch_size)


def decay_horizon(a: ImpalaAlgorithmConfig, schedule: str, max_env_steps: int | None) -> int | None:
    """Env steps over which the ``lr`` or ``entropy`` linear schedule decays: its own
    ``{schedule}_decay_env_steps``, else the run's ``max_env_steps`` (``None``: neither set)."""
    return getattr(a, f"{schedule}_decay_env_steps") or max_env_steps


def steps_per_batch(a: ImpalaAlgorithmConfig) -> int:
    """Optimizer steps the learner takes on one batch: ``num_passes * num_minibatches``."""
    return a.num_passes * a.num_minibatches


COMPILE_MIN_STEPS = 10_000
"""``compile_update=null`` compiles an MLP's update on a run of at least this many optimizer
steps: at ~4 ms saved a step they win back a ~20-30 s compile on 2 cores."""


COMPILE_GRID_SIDE = 16
"""Convolutions over images of at most this many cells a side (a grid world's 7x7 view) leave
the step bound by per-op overhead, as an MLP's is: ``compile_update=null`` compiles them too
(MiniGrid Unlock under the ``minigrid`` preset: a batch's learner work 0.81x, the whole
100k-step run 0.78x, the same score; docs/experiments/any-env.md)."""


def pixel_convolutions(convolutions: bool, image_side: int) -> bool:
    """Convolutions over an image longer than :data:`COMPILE_GRID_SIDE` a side (``image_side``:
    the longest image side the model reads): a step of compute, not per-op overhead."""
    return convolutions and image_side > COMPILE_GRID_SIDE


def compile_pays(pixels: bool, planned_steps: float) -> bool:
    """``compile_update=null``'s rule, for the learner and the console alike: a model without
    ``pixels``, convolutions over images longer than :data:`COMPILE_GRID_SIDE` (its step then mostly
    per-op overhead) over at least :data:`COMPILE_MIN_STEPS` optimizer steps."""
    return not pixels and planned_steps >= COMPILE_MIN_STEPS


def one_program_refusal(
    *, several_learners: bool, step_keys: int, lstm_core: bool, precision: str
) -> str | None:
    """Why an update cannot run as one program (a CUDA graph or a compiled one) on any
    device (``None``: it can): several learners exchange gradients in mid-update, several
    step keys pick rows by data, the core splits its sequence by data read on the host, and
    bf16 autocast keeps a cast cache across calls. From plain facts, so that the console can
    say before the run what the learner will decide."""
    if several_learners:
        return "several learners average gradients in mid-update"
    if step_keys != 1:
        return "a structured env's step keys pick rows by data"
    if lstm_core:
        return "the LSTM core cuts its sequence where episodes start, read on the host"
    if precision != "fp32":
        return "bf16 autocast"
    return None


def planned_optimizer_steps(cfg: RunConfig) -> float:
    """The optimizer steps a run takes to ``max_env_steps`` (``inf`` without one), counting
    ``actors_batch_size * envs_per_actor * n_rollout_steps`` env steps a batch."""
    a = cfg.algorithm
    if cfg.max_env_steps is None:
        return math.inf
    batch_env_steps = a.actors_batch_size * a.envs_per_actor * a.n_rollout_steps
    return cfg.max_env_steps / batch_env_steps * steps_per_batch(a)


def broadcasts_after(a: ImpalaAlgorithmConfig, taken: int) -> bool:
    """Whether the ``taken``-th optimizer step of a batch (from 1) broadcasts the weights:
    every ``broadcast_every``-th step and the batch's last."""
    steps = steps_per_batch(a)
    return taken % (a.broadcast_every or steps) == 0 or taken == steps


def handout_lag_bound(a: ImpalaAlgorithmConfig) -> int | None:
    """The policy lag a rollout may have when its batch is handed out, so that every step on
    the batch stays within ``max_policy_lag`` (``None``: no bound)."""
    return None if a.max_policy_lag is None else a.max_policy_lag - (steps_per_batch(a) - 1)


def check_num_minibatches(a: ImpalaAlgorithmConfig, columns: int, rows: int | None = None) -> None:
    """Refuse a ``num_minibatches`` that does not divide a batch's ``columns`` (its decisions,
    ``columns`` times ``rows`` (``n_rollout_steps``) each, with ``minibatch_of=steps``)."""
    count, unit = columns, "columns (actors_batch_size * envs_per_actor * the env's agents)"
    if a.minibatch_of == "steps":
        count *= a.n_rollout_steps if rows is None else rows
        unit = (
            "decisions (actors_batch_size * envs_per_actor * the env's agents * "
            "n_rollout_steps) with minibatch_of=steps"
        )
    if count % a.num_minibatches:
        _refuse(
            "algorithm.num_minibatches",
            f"a divisor of the batch's {count} {unit}",
            a.num_minibatches,
        )


def check_queue_out_of_sync_factor(a: ImpalaAlgorithmConfig) -> None:
    """Refuse a factor whose queue holds fewer rollouts than one batch (no batch ever forms)."""
    factor, batch = a.queue_out_of_sync_factor, a.actors_batch_size
    if max_waiting_rollouts(a) < batch:
        _refuse(
            "algorithm.queue_out_of_sync_factor",
            "a finite number with ceil(factor * actors_batch_size) >= actors_batch_size, i.e. "
            f"> {(batch - 1) / batch:g} for actors_batch_size={batch}",
            factor,
        )


def check_encoders(m: ModelConfig) -> None:
    """Kwargs only for encoders given by import path; a value encoder only for a value torso
    of its own (``shared_torso: false``)."""
    for key, encoder in (("encoder", m.encoder), ("value_encoder", m.value_encoder)):
        kwargs = getattr(m, f"{key}_kwargs")
        if kwargs and not is_import_path(encoder):
            _refuse(
                f"model.{key}_kwargs",
                f"{{}} unless model.{key} is an encoder given by import path "
                "(package.module:Class); a built-in one takes model.hidden_sizes and "
                "model.activation",
                dict(kwargs),
            )
    for key in ("value_encoder", "value_obs_keys"):
        if getattr(m, key) is not None and m.shared_torso:
            _refuse(
                f"model.{key}",
                "null when model.shared_torso is true (one torso feeds both heads)",
                getattr(m, key),
            )


def check_rules(cfg: RunConfig, section: str = "") -> None:
    """Check the :data:`RULES` of the keys under ``section`` (``"env"``; all by default):
    each key's own range or choice, which no other field changes."""
    prefix = f"{section}." if section else ""
    for key, rule in RULES.items():
        if not key.startswith(prefix):
            continue
        value = _get(cfg, key)
        if value is None and rule.nullable:
            continue
        if value is None or not rule.ok(value):
            _refuse(key, rule.valid, value)


def validate(cfg: RunConfig) -> None:
    """Check :data:`RULES`, each entry of ``runner.ray_resources_per_actor``, then the rules
    that relate two fields."""
    check_rules(cfg)
    for pattern in cfg.log.console_stats:
        if not (isinstance(pattern, str) and pattern.strip()):
            _refuse("log.console_stats", "a list of non-empty glob patterns", pattern)
    for name, amount in cfg.runner.ray_resources_per_actor.items():
        if not (name and _number(amount) and amount > 0):
            _refuse(
                f"runner.ray_resources_per_actor.{name}",
                "a resource name mapped to a number > 0",
                amount,
            )
    if cfg.runner.inference != "actor" and cfg.runner.backend != "subprocess":
        _refuse(
            "runner.inference",
            f"actor with runner.backend={cfg.runner.backend} (central inference, in a process "
            "or in the learner's, serves subprocess actors)",
            cfg.runner.inference,
        )
    if cfg.env.vector == "async" and cfg.runner.backend != "sequential":
        _refuse(
            "env.vector",
            f"python, envpool or auto with runner.backend={cfg.runner.backend} (its actors "
            "already step in processes of their own; async puts the sequential backend's envs "
            "in processes)",
            cfg.env.vector,
        )
    a = cfg.algorithm
    if cfg.runner.inference_servers > 1 and cfg.runner.inference != "central":
        why = {"actor": "each actor acts itself", "learner": "one thread of the learner serves"}
        _refuse(
            "runner.inference_servers",
            f"1 with runner.inference={cfg.runner.inference} ({why[cfg.runner.inference]})",
            cfg.runner.inference_servers,
        )
    if cfg.runner.env_splits > 1 and cfg.runner.inference == "actor":
        _refuse(
            "runner.env_splits",
            "1 with runner.inference=actor (a group waits for answers only from a server)",
            cfg.runner.env_splits,
        )
    if a.envs_per_actor % cfg.runner.env_splits:
        _refuse(
            "runner.env_splits",
            f"a divisor of algorithm.envs_per_actor={a.envs_per_actor} (each group steps as "
            "many envs)",
            cfg.runner.env_splits,
        )
    check_queue_out_of_sync_factor(a)
    if a.num_actors % a.num_learners:
        _refuse(
            "algorithm.num_learners",
            f"a divisor of algorithm.num_actors={a.num_actors} (each learner takes the "
            "batches of as many actors)",
            a.num_learners,
        )
    # each learner runs runner.inference_servers servers for its own actors' env groups
    groups = a.num_actors // a.num_learners * cfg.runner.env_splits
    if cfg.runner.inference_servers > groups:
        parts = [f"algorithm.num_actors={a.num_actors}"]
        if a.num_learners > 1:
            parts.append(f"/ algorithm.num_learners={a.num_learners}")
        if cfg.runner.env_splits > 1:
            parts.append(f"x runner.env_splits={cfg.runner.env_splits}")
        _refuse(
            "runner.inference_servers",
            f"at most {groups} ({' '.join(parts)}: the env groups of each learner's actors; "
            "every learner runs this many servers for its own, and a server without actors "
            "idles)",
            cfg.runner.inference_servers,
        )
    if a.max_policy_lag is not None and a.max_policy_lag < steps_per_batch(a) - 1:
        steps = "num_passes" if a.num_minibatches == 1 else "num_passes * num_minibatches"
        _refuse(
            "algorithm.max_policy_lag",
            f"null or an integer >= {steps} - 1 = {steps_per_batch(a) - 1} (step n on a batch "
            "sees n more updates than its first)",
            a.max_policy_lag,
        )
    for schedule, horizon in (("lr", "lr_decay_env_steps"), ("entropy", "entropy_decay_env_steps")):
        if (
            getattr(a, f"{schedule}_schedule") == "linear"
            and decay_horizon(a, schedule, cfg.max_env_steps) is None
        ):
            _refuse(
                f"algorithm.{horizon}",
                f"an integer >= 1 (or set max_env_steps) when {schedule}_schedule is linear",
                getattr(a, horizon),
            )
    m = cfg.model
    check_encoders(m)
    for key, field_name in (("actor_hidden_sizes", "encoder"), ("critic_hidden_sizes", "")):
        encoder = m.encoder if field_name else (m.value_encoder or m.encoder)
        if getattr(m, key) is not None and (m.shared_torso or encoder not in VECTOR_ENCODERS):
            _refuse(
                f"model.{key}",
                "null when model.shared_torso is true or its torso's encoder is not auto or mlp "
                "(set model.hidden_sizes instead)",
                getattr(m, key),
            )
    if m.normalize_obs and m.encoder not in VECTOR_ENCODERS:
        reason = (
            "normalize inside your encoder"
            if is_import_path(m.encoder)
            else "images are scaled to [0, 1] already"
        )
        _refuse(
            "model.normalize_obs",
            f"false for model.encoder={m.encoder} ({reason})",
            m.normalize_obs,
        )
    if m.core != "none" and a.minibatch_of == "steps":
        _refuse(
            "algorithm.minibatch_of",
            f"columns when model.core={m.core} (the core trains on whole sequences)",
            a.minibatch_of,
        )
    if a.step_targets != "pass" and a.minibatch_of != "steps":
        _refuse(
            "algorithm.step_targets",
            "pass unless algorithm.minibatch_of=steps (column minibatches run V-trace at each "
            "optimizer step)",
            a.step_targets,
        )
    if m.core != "none" and not m.shared_torso:
        _refuse(
            "model.shared_torso",
            f"true when model.core={m.core} (one torso feeds the core)",
            m.shared_torso,
        )
