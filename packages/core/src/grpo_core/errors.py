"""Errors caused by user input. The CLI prints them as one line and exits 2."""


class UserError(Exception):
    """Bad input: a config, a path, a name. The message says what, the value, and the fix."""


class ConfigError(UserError):
    """A config file or override that does not validate."""


class PluginError(UserError):
    """A plugin that cannot be loaded, a duplicate name or an unknown name."""
