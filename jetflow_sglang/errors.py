"""User-facing errors: the CLI prints them as one line and exits non-zero."""


class JetFlowError(Exception):
    """Bad input from the user (a path, a flag, a checkpoint that does not fit)."""
