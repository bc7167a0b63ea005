"""The one base class of every error this package reports to a user.

Each module keeps its own error class (``ConfigError``, ``CheckpointError``, ``GenerationError``, ...), named for
what went wrong and still a ``ValueError`` or ``RuntimeError`` as before; all of them also derive from
:class:`MsEagleError`, so the command line and the server catch one class and print or return its one-line message
(docs/errors.md). Pure Python: importing it never loads MindSpore.
"""
from __future__ import annotations


class MsEagleError(Exception):
    """A known, user-facing error: its message names the field, file or value and what is allowed."""


__all__ = ["MsEagleError"]
