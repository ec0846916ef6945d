"""impala-rl: IMPALA (Espeholt et al., 2018) with V-trace, in PyTorch.

``train(config)`` runs what ``impala train`` runs and returns the summary;
``load_policy(run_dir)`` gives a policy with ``act(obs, deterministic=...)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__version__ = "0.1.0"


def train(
    config: Any = None,
    overrides: list[str] | None = None,
    run_dir: str | Path | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """Train as the CLI does. ``config``: a :class:`RunConfig`, a preset name or a YAML path;
    ``None``: defaults for the ``env.id`` in ``overrides`` (else the ``cartpole`` preset)."""
    from impala_rl.config import RunConfig, load_config, to_dict
    from impala_rl.distributed import check_not_importing_main
    from impala_rl.env_defaults import resolve_config
    from impala_rl.policy import load_run_config
    from impala_rl.trainer import Trainer

    check_not_importing_main()
    if resume:
        if run_dir is None:
            raise ValueError("resume=True needs run_dir")
        cfg = load_run_config(run_dir, overrides)
    elif isinstance(config, RunConfig):
        cfg = load_config(base=to_dict(config), overrides=overrides)
    else:
        cfg = resolve_config(config, overrides)
    return Trainer(cfg, run_dir=run_dir, resume=resume).train()


def load_policy(run_dir: str | Path, which: str = "best") -> Any:
    """The best (or last) policy of a finished or running run directory."""
    from impala_rl.policy import load_policy as _load_policy

    return _load_policy(run_dir, which)


__all__ = ["__version__", "load_policy", "train"]
