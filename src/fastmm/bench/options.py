"""What every benchmark command line shares: value types that refuse a bad value before any
work starts (argparse's one-line error, exit 2, not a traceback after the run), ``--quick``
presets that fill only what the user left out, and an exit that a signal cannot turn into a
traceback or left-over temporary data."""

from __future__ import annotations

import argparse
import functools
import math
import os
import signal
import sys
import threading
from pathlib import Path


def whole(minimum: int = 1):
    """An integer of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def number(minimum: float = 0.0, *, above: bool = True, below: float = math.inf):
    """A finite number above ``minimum`` (or at least it, with ``above=False``) and below
    ``below``: a NaN or infinite window would never close."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        low_ok = value > minimum if above else value >= minimum
        if not (math.isfinite(value) and low_ok and value < below):
            bound = f"{'above' if above else 'at least'} {minimum:g}"
            if below < math.inf:
                bound += f" and below {below:g}"
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


def listed(item, choices=None):
    """A comma-separated list of ``item`` values (``choices``: the names allowed)."""

    def parse(text: str) -> list:
        values = [v.strip() for v in text.split(",") if v.strip()]
        if not values:
            raise argparse.ArgumentTypeError("needs at least one value")
        if choices is not None and set(values) - set(choices):
            raise argparse.ArgumentTypeError(
                f"unknown {sorted(set(values) - set(choices))}; choose from {','.join(choices)}")
        return [item(v) for v in values]

    parse.__name__ = "list"
    return parse


def directory(text: str) -> str:
    """A directory that is there or can be made, and written in: refused now, not after the
    run it would have held."""
    path = Path(text).absolute()
    there = next(p for p in (path, *path.parents) if p.exists())
    if not there.is_dir():
        raise argparse.ArgumentTypeError(f"{there} is not a directory")
    if not os.access(there, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{there} is not writable")
    return text


def parse(parser: argparse.ArgumentParser, argv=None, quick: dict | None = None):
    """The parsed arguments; with ``--quick``, ``quick``'s values are the defaults, so a value
    given on the command line still wins."""
    args = parser.parse_args(argv)
    if quick and args.quick:
        kept = {name: parser.get_default(name) for name in quick}
        parser.set_defaults(**quick)
        try:
            args = parser.parse_args(argv)
        finally:
            parser.set_defaults(**kept)
    return args


def _after_fork_in_child() -> None:
    if signal.getsignal(signal.SIGTERM) is signal.default_int_handler:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


os.register_at_fork(after_in_child=_after_fork_in_child)


def command(main):
    """A benchmark's ``main``: SIGTERM (``timeout``, a scheduler) ends it as Ctrl-C does, so
    temporary data is removed on the way out, and either ends in one line and exit code 130,
    not a traceback. Forked children (loader workers) keep SIGTERM's default: they die of it
    at once."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs) -> int:
        in_main = threading.current_thread() is threading.main_thread()  # where signals go
        previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if in_main else None
        try:
            return main(*args, **kwargs)
        except KeyboardInterrupt:
            print(f"{main.__module__}: interrupted; its results were not written (what was "
                  "already in its output directory is kept)", file=sys.stderr)
            return 130
        finally:
            if in_main:
                signal.signal(signal.SIGTERM, previous)

    return wrapped


def temporary_directory(prefix: str, work_dir: str | None) -> str:
    """A new directory for a run's temporary copies, under ``--work-dir`` (made if it is not
    there yet; the system's temporary directory without one)."""
    import tempfile

    if work_dir:
        os.makedirs(work_dir, exist_ok=True)
    return tempfile.mkdtemp(prefix=prefix, dir=work_dir)
