"""Horovod's ``horovod.runner.common.util.config_parser.set_env_from_args``: the environment
variables the launcher's tuning flags set (``SPARK_HVD_*``, which every rank reads)."""

from spark_hvd.runner._env import config_env


def set_env_from_args(env, args):
    """Adds to ``env`` the variables for the tuning flags in ``args`` (a parsed command line of
    ``spark-hvd-run``, e.g. from ``spark_hvd.runner.launch.parse_args()``); returns ``env``."""
    env.update(config_env(args))
    return env
