"""Errors the CLI prints as one line, exiting with `exit_code`."""


class UserError(Exception):
    """Bad input: a config, a path, a name. The message says what, the value, and the fix."""

    exit_code = 2


class ConfigError(UserError):
    """A config file or override that does not validate."""


class PluginError(UserError):
    """A plugin that cannot be loaded, a duplicate name or an unknown name."""


class DoesNotFit(UserError):
    """A run whose compiled programs need more memory than the device has (exit 3, as `--plan`)."""

    exit_code = 3


class RunFault(UserError):
    """The machine failed the run (a full disk, a directory turned read-only): exit 1 like any
    failure that is not bad input, but a one-line message, since the cause is known."""

    exit_code = 1
