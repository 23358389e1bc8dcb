"""User-facing errors.

Anything a user can cause (a bad recipe, a missing file, a checkpoint that does not fit the model)
raises a subclass of :class:`NxdError` with a one-line message that names the problem. The CLI
prints ``error: <message>`` and exits with code 2; it never shows a traceback for these.
"""


class NxdError(Exception):
    """Base class of errors caused by user input; ``str(e)`` is one line shown as is."""


class RecipeError(NxdError):
    """The recipe (YAML or overrides) is invalid."""


class ModelLoadError(NxdError):
    """A model directory or checkpoint is unreadable, incomplete or of the wrong shape."""


class AdapterError(NxdError):
    """An adapter is malformed or does not fit the base model."""


class DataError(NxdError):
    """A dataset cannot be read or does not fit the chosen format."""
