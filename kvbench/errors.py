"""User-facing error types; the CLI maps them to exit codes."""


class InputError(Exception):
    """Bad user input (YAML, overrides, traces, usage): printed as one line, exit code 2."""


class RegressionFound(Exception):
    """`kvbench compare` found a regression: exit code 3."""
