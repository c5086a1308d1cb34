"""fastmm's own error and warning bases: SampleError (under SourceError and DecodeError: one bad
sample, named by ``reason``, its counter under on_error="skip"/"replace", and ``key``) and
FastmmWarning."""

from __future__ import annotations

import ast
import re

# the last line of a worker's traceback: "...DecodeError: reason: message (key='k'...)"
_LAST_LINE = re.compile(r"Error: (\w+): .*\(key=('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")")


class FastmmWarning(UserWarning):
    """The loader runs, but something here will hurt (a pre-flight finding, a deadline that
    cannot be enforced)."""


class SampleError(ValueError):
    """A sample that could not be read or decoded.

    Built from one argument, it is the error torch's DataLoader re-raises in the main process
    for one a worker raised (``type(text)``, the worker's traceback as text): ``reason`` and
    ``key`` are read back from that text, so the error keeps its type and its fields."""

    def __init__(self, text: str):
        super().__init__(text)
        found = _LAST_LINE.search(text.rstrip().rsplit("\n", 1)[-1])
        self.reason = found.group(1) if found else "other"
        self.key = ast.literal_eval(found.group(2)) if found else ""
