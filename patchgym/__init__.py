"""patchgym: train software-engineering agents with reinforcement learning."""

import gymnasium

from patchgym.envs import AsyncSWEEnv, EnvConfig, SWEEnv

__version__ = "0.1.0"
ENV_ID = "patchgym/SWE-v0"

if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point="patchgym.envs.swe:SWEEnv")

__all__ = ["ENV_ID", "AsyncSWEEnv", "EnvConfig", "SWEEnv", "__version__"]
