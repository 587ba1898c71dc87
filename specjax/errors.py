"""User-facing errors.

Every mistake a user can make (bad flag, bad prompt, unknown model, malformed
input line) raises :class:`SpecjaxError` with a one-line message. Launch scripts
catch it and print the message without a stack trace; anything else is a bug.
"""


class SpecjaxError(ValueError):
    """A user error with a one-line, actionable message."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise SpecjaxError(message)
