import sys


class BenchError(Exception):
    """A problem with the user's input or environment. Printed as one line, exit code 2:
    the message names what is wrong and what is allowed or how to fix it."""


def fail(message) -> None:
    """Bad input's ending, for every command: one line naming what is wrong, exit code 2."""
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
    sys.exit(2)
