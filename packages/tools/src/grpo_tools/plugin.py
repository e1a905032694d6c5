"""Entry point of the built-in tools (registered like any third-party plugin)."""
