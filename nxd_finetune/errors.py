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


class NxdWarning(UserWarning):
    """Something a user should read that does not stop the run (a skipped checkpoint, a clamped
    setting). :func:`show_warnings_as_lines` prints these as one ``warning: ...`` line."""


def show_warnings_as_lines() -> None:
    """Print :class:`NxdWarning` as one ``warning: <message>`` line on stderr (no source file, line
    or code line, as Python's default would); other warnings keep Python's format. Each process
    that prints (the CLI, every worker) calls this once."""
    import sys
    import warnings

    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
        if isinstance(category, type) and issubclass(category, NxdWarning):
            print(f"warning: {' '.join(str(message).split())}", file=file or sys.stderr, flush=True)
            return
        default(message, category, filename, lineno, file, line)

    warnings.showwarning = show
