"""The one user-facing error type: the CLI turns it into one stderr line and exit status 2."""


class RecycleError(Exception):
    """Bad input from the user (missing file, corrupt weights, unknown layout...).

    The message must be a single line that says what is wrong and, where it helps, what to do.
    """

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


class Interrupted(RecycleError):
    """SIGINT/SIGTERM stopped a long run: the message says what was saved; `resumable` says whether the same
    command with --resume continues it. The CLI exits 130 (the shell's code for an interrupt), not 2."""

    exit_code = 130

    def __init__(self, message: str, resumable: bool = False) -> None:
        super().__init__(message)
        self.resumable = resumable
