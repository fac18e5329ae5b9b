"""The config's error type, importable by every config module without importing the loader."""


class ConfigError(ValueError):
    """A config that cannot run. The message names the key(s) and value(s) involved."""
