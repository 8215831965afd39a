"""The one user-facing error type: the CLI turns it into one stderr line and exit status 2."""


class RecycleError(Exception):
    """Bad input from the user (missing file, corrupt weights, unknown layout...).

    The message must be a single line that says what is wrong and, where it helps, what to do.
    """

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))
