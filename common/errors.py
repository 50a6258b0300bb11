"""Errors every layer may raise without importing anything heavy."""


class ConfigError(ValueError):
    """A run-config key is unknown or has a value that is not allowed."""
