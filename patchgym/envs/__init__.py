"""Environments."""

from patchgym.envs.swe import AsyncSWEEnv, EnvConfig, SWEEnv

__all__ = ["AsyncSWEEnv", "EnvConfig", "SWEEnv"]
