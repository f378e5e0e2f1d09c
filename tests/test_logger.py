"""mlxspec.logger: library lines go to logging.getLogger("mlxspec"); the CLI prints them bare."""

from __future__ import annotations

import io
import logging

from mlxspec import cli
from mlxspec.logger import capture, logger, say, to_stderr


def test_say_goes_to_a_given_stream_else_to_the_logger(capsys, caplog):
    buf = io.StringIO()
    say("mlxspec: to the stream", buf)
    assert buf.getvalue() == "mlxspec: to the stream\n"
    with caplog.at_level(logging.INFO, logger="mlxspec"):
        say("mlxspec: info line")
        say("mlxspec: warning: careful", level=logging.WARNING)
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("mlxspec", logging.INFO, "mlxspec: info line"), ("mlxspec", logging.WARNING, "mlxspec: warning: careful")]
    assert capsys.readouterr().err == ""


def test_to_stderr_prints_bare_lines_and_restores_the_logger(capsys):
    before = (logger.handlers[:], logger.level, logger.propagate)
    with to_stderr():
        say("mlxspec: one")
        say("mlxspec: warning: two", level=logging.WARNING)
    say("mlxspec: after")  # INFO outside: not printed
    assert capsys.readouterr().err == "mlxspec: one\nmlxspec: warning: two\n"
    assert (logger.handlers, logger.level, logger.propagate) == before


def test_capture_collects_instead_of_printing(capsys):
    with to_stderr():
        with capture() as lines:
            say("mlxspec: captured")
        say("mlxspec: printed")
    assert lines == ["mlxspec: captured"]
    assert capsys.readouterr().err == "mlxspec: printed\n"


def test_cli_main_prints_library_lines(capsys, monkeypatch):
    """A command's library lines reach stderr through cli.main (here: a stand-in command)."""
    monkeypatch.setattr(cli, "cmd_inspect", lambda a: say("mlxspec: from the library") or 0)
    assert cli.main(["inspect", "anything"]) == 0
    assert capsys.readouterr().err == "mlxspec: from the library\n"
