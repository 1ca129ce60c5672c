class BenchError(Exception):
    """A problem with the user's input or environment. Printed as one line, exit code 2:
    the message names what is wrong and what is allowed or how to fix it."""
