"""User-facing error types; the CLI maps them to exit codes."""


class InputError(Exception):
    """Bad user input (YAML, overrides, traces, usage): printed as one line, exit code 2."""


class RegressionFound(Exception):
    """`kvbench compare` found a regression: exit code 3."""


class TraceWarning(UserWarning):
    """Something in a trace that is probably a mistake but still readable (a unit, no prefix
    information); the CLI prints it as one `kvbench: warning:` line."""
