"""The `mlxspec` logger: library code reports through it, the command line prints it.

Library code calls `say(line)` (or `say(line, level=logging.WARNING)`): the line goes to
`logging.getLogger("mlxspec")`, so an application decides what it sees. Unconfigured, Python
shows warnings on stderr and drops the informational lines (the drafter's init line, the
`--draft auto` choice). The `mlxspec` command wraps each command in `to_stderr()`, which prints
every record as the bare line on stderr, so its output is what it always was.

An app that shows the lines its own way collects them with `capture()` (`mlxspec inspect`,
the benchmark's rows). Functions that took a `log=` stream (`mlxspec.drafters.load.load_drafter`,
`mlxspec.api.load`, `mlxspec.api.load_speculator`, `mlxspec.api.resolve_auto_draft`,
`mlxspec.targets.convert.cached_mlx_copy`) still take one: given a stream, `say` writes the
line there instead (tests and scripts capture with it).
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager

logger = logging.getLogger("mlxspec")


def say(line: str, log=None, level: int = logging.INFO) -> None:
    """Report one line: to the stream `log` when given, else to the `mlxspec` logger."""
    if log is not None:
        print(line, file=log)
    else:
        logger.log(level, line)


class _Stderr(logging.Handler):
    """Each record as its bare message on the current `sys.stderr` (looked up per record, so a
    redirect made after the handler was installed, or pytest's capture, sees it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stderr)
        except Exception:  # pragma: no cover - logging's own convention
            self.handleError(record)


@contextmanager
def to_stderr():
    """While the block runs, print the `mlxspec` logger's records (INFO and up) to stderr as
    plain lines, and only there (the command line's output)."""
    handler = _Stderr()
    handler.setFormatter(logging.Formatter("%(message)s"))
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


class _Lines(logging.Handler):
    def __init__(self, lines: list[str]):
        super().__init__()
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def capture():
    """While the block runs, collect the `mlxspec` logger's lines (INFO and up) in the list it
    yields, instead of showing them anywhere."""
    lines: list[str] = []
    handlers, level, propagate = logger.handlers[:], logger.level, logger.propagate
    logger.handlers = [_Lines(lines)]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield lines
    finally:
        logger.handlers = handlers
        logger.setLevel(level)
        logger.propagate = propagate
