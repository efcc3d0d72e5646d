"""The command line and its configuration: flags + config file + env -> `LaunchConfig`.

``build_config(argv, env)`` is the whole parse (pure apart from notes on stderr), ``main`` the
``meshrun`` console script. Importing this package does not import torch or the agent.
"""

from meshrun.agent.config import LaunchConfig, Std, StdSpec
from meshrun.launcher.build import build_config
from meshrun.launcher.cli import main
from meshrun.launcher.errors import ConfigError

__all__ = ["ConfigError", "LaunchConfig", "Std", "StdSpec", "build_config", "main"]
