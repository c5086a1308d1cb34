"""fastmm's own error and warning bases: SampleError (under SourceError and DecodeError: one bad
sample, named by ``reason``, its counter under on_error="skip"/"replace", ``key`` and
``origin``) and FastmmWarning."""

from __future__ import annotations

import ast
import re

_QUOTED = r"""('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")"""
# the last line of a worker's traceback: "...DecodeError: reason: message (key='k', origin='o')";
# anchored at the end, so a key or message that holds "(key=...)" itself is not mistaken for it
_LAST_LINE = re.compile(rf"(?:^|Error: )(\w+): .*\(key={_QUOTED}, origin={_QUOTED}\)$")


class FastmmWarning(UserWarning):
    """The loader runs, but something here will hurt (a pre-flight finding, a deadline that
    cannot be enforced)."""


class SampleError(ValueError):
    """A sample that could not be read or decoded: ``reason``, ``key``, ``origin`` and a
    one-line message.

    Built from one argument, it is the error torch's DataLoader re-raises in the main process
    for one a worker raised (``type(text)``, the worker's traceback as text): the fields are read
    back from that text, so the error keeps its type and its fields.

    Args:
        reason: a short counter name ("corrupt", "too_large", ...); given alone, the worker's
            traceback as text.
        key: the sample's key; None: ``reason`` is a worker's text.
        origin: the file, or ``shard.tar:offset``; set by the dataset for a decode error.
        message: what went wrong, in one line (line breaks become spaces).
    """

    def __init__(self, reason: str, key: str | None = None, origin: str = "",
                 message: str = ""):
        if key is None:  # re-raised from a worker's text
            super().__init__(reason)
            self.text = reason
            found = _LAST_LINE.search(reason.rstrip().rsplit("\n", 1)[-1])
            self.reason = found.group(1) if found else "other"
            self.key, self.origin = ((ast.literal_eval(found.group(2)),
                                      ast.literal_eval(found.group(3))) if found else ("", ""))
            self.message = reason
            return
        super().__init__(reason, key, origin, message)
        self.text = None
        self.reason, self.key, self.origin = reason, key, origin
        self.message = " ".join(str(message).splitlines())  # one line, for the text form

    def __str__(self) -> str:  # built when shown, so an origin set later is in it
        if self.text is not None:
            return self.text
        return f"{self.reason}: {self.message} (key={self.key!r}, origin={self.origin!r})"

    def __reduce__(self):  # pickled as its text, read back like a worker's
        return type(self), (str(self),)
