"""The one exception type for mistakes a user can cause.

Raised with a single line that names the file or flag, what is wrong and what to do.
The CLI prints it (no traceback) and exits with code 2.
"""


class MlxspecError(ValueError):
    """A user-facing error: bad file, bad flag, incompatible models. A ValueError, so
    `except ValueError` catches it too."""

    exit_code = 2

    def __init__(self, message: str):
        # One line (the CLI prints str(e) as is), even when the message quotes bytes from a corrupt file.
        text = " ".join(str(message).splitlines())
        super().__init__("".join(c if c.isprintable() else "?" for c in text))
