"""The one exception type the CLI turns into a one-line error message."""


class TorqError(Exception):
    """A user-facing error: bad input, a missing file, an unsupported model."""


def first_line(exc: BaseException) -> str:
    """``Type: first line of its message``: a library's exception, fit for a one-line error."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
