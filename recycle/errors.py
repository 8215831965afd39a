"""The one user-facing error type: the CLI turns it into one stderr line and exit status 2."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


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


def did_you_mean(value: object, choices: Iterable[object]) -> str:
    """`; did you mean 'eagle'?` for a mistyped choice (`--to eagel`) close to one of `choices` (difflib's
    similarity, case ignored), else ''. A refusal appends it to its one line."""
    by_lower = {str(c).lower(): str(c) for c in choices}
    close = difflib.get_close_matches(str(value).strip().lower(), list(by_lower), n=1, cutoff=0.6)
    return f"; did you mean {by_lower[close[0]]!r}?" if close else ""
