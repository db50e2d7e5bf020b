"""What a bulk job reports instead of a traceback: one line that says what to do."""

from __future__ import annotations


class BulkError(RuntimeError):
    """A problem with the input, the output or the job; the message names the file and line."""


class UsageError(BulkError):
    """The command as given cannot run (a bad option, file or combination): exit code 2."""


class JobChanged(UsageError):
    """An unfinished job's input, model or options differ from this run's."""
