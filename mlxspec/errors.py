"""The one exception type for mistakes a user can cause.

Raised with a single line that names the file or flag, what is wrong and what to do.
The CLI prints it (no traceback) and exits with code 2.
"""


class MlxspecError(ValueError):
    """A user-facing error: bad file, bad flag, incompatible models. A ValueError, so
    `except ValueError` catches it too."""

    exit_code = 2

    def __init__(self, message: str):
        # Keep it to one line: the CLI prints str(e) as is.
        super().__init__(" ".join(str(message).split("\n")))
