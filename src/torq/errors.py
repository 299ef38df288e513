"""The one exception type the CLI turns into a one-line error message."""


class TorqError(Exception):
    """A user-facing error: bad input, a missing file, an unsupported model."""
