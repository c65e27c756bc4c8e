"""What loading raises: ``ModelNotFound`` and ``LoadError`` (one line naming the file and the problem)."""

from __future__ import annotations


class ModelNotFound(Exception):
    """A model spec that names nothing loadable; the message says what to do."""


class LoadError(ModelNotFound):
    """A model file that is there but cannot be loaded (not a GGUF, truncated,
    an unsupported architecture), or a conversion cache that cannot be written.
    One line naming the file and the problem."""


def error_detail(e: BaseException) -> str:
    """The first line of an exception's message (its type's name if it has none)."""
    return (str(e).splitlines() or [type(e).__name__])[0]
