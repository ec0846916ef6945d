"""impala-rl: IMPALA (Espeholt et al., 2018) with V-trace, in PyTorch.

``train(config)`` runs what ``impala train`` runs and returns the summary;
``load_policy(run_dir)`` gives a policy with ``act(obs, deterministic=...)``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

__version__ = "0.1.0"


def train(
    config: Any = None,
    overrides: list[str] | None = None,
    run_dir: str | Path | None = None,
    resume: bool = False,
    env: str | Callable[..., Any] | None = None,
) -> dict[str, Any]:
    """Train as the CLI does. ``config``: a :class:`RunConfig`, a preset name or a YAML path;
    ``None``: defaults for the ``env.id`` in ``overrides`` (else the ``cartpole`` preset).
    ``env``: the ``env.id`` itself, an id or a class or function returning a
    ``gymnasium.Env`` (``train(env=MyEnv)``; one defined in a notebook too), its arguments
    ``env.kwargs.*`` in ``overrides``."""
    from impala_rl.machine import set_omp_spin_count

    set_omp_spin_count()  # before torch is loaded, where it is not yet
    from impala_rl.config import RunConfig, load_config, to_dict
    from impala_rl.distributed import check_not_importing_main
    from impala_rl.env_defaults import resolve_config
    from impala_rl.policy import load_run_config
    from impala_rl.trainer import Trainer

    check_not_importing_main()
    if env is not None:
        overrides = [f"env.id={_env_id(env)}", *(overrides or [])]
    if resume:
        if run_dir is None:
            raise ValueError("resume=True needs run_dir")
        cfg = load_run_config(run_dir, overrides)
    elif isinstance(config, RunConfig):
        cfg = load_config(base=to_dict(config), overrides=overrides)
    else:
        cfg = resolve_config(config, overrides)
    return Trainer(cfg, run_dir=run_dir, resume=resume).train()


def _env_id(env: str | Callable[..., Any]) -> str:
    """The ``env.id`` of ``train``'s ``env``: an id as it is, a callable as its import path
    (``module:qualname``, which every process of the run imports, or carries by value for a
    notebook's)."""
    import gymnasium as gym

    if isinstance(env, str):
        return env
    if isinstance(env, gym.Env):
        spec = env.spec
        made = f" (made from the id {spec.id!r}: env={spec.id!r})" if spec is not None else ""
        raise ValueError(
            f"env={env!r} is an env, not what builds one: the run builds a copy per actor env; "
            f"pass its class or a function that returns one{made}"
        )
    module, name = getattr(env, "__module__", None), getattr(env, "__qualname__", "")
    if not callable(env) or not module or not name or "<" in name:
        raise ValueError(
            f"env={env!r}: valid: an env id, or a class or function defined at a module's top "
            "level (a lambda or a function defined inside another has no name the run's "
            "processes can find)"
        )
    return f"{module}:{name}"


def load_policy(run_dir: str | Path, which: str = "best") -> Any:
    """The best (or last) policy of a finished or running run directory."""
    from impala_rl.policy import load_policy as _load_policy

    return _load_policy(run_dir, which)


__all__ = ["__version__", "load_policy", "train"]
