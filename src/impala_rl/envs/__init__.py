"""Environment creation: factories from ids or callables, wrappers, vector envs."""

from impala_rl.envs.factory import (
    EnvError,
    EnvFactory,
    make_env_factory,
    make_keyed_vector_env,
    make_vector_env,
    model_observation_space,
)

__all__ = [
    "EnvError",
    "EnvFactory",
    "make_env_factory",
    "make_keyed_vector_env",
    "make_vector_env",
    "model_observation_space",
]
