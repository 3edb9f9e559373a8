"""The progress line (jaxdecode.progress) and the command's start-up (jaxdecode.__main__).

What a terminal shows is replayed from the bytes written with a small model of the few control sequences
rich's live display uses (carriage return, erase line, cursor up, colours), so that "the line is gone
when the phase ends" is checked on the screen, not on rich's output format.
"""

import io
import os
import re
import subprocess
import sys
import time

import pytest

from jaxdecode import progress
from jaxdecode.__main__ import _wants_json
from jaxdecode.bench.startup import run_on_ptys

_CSI = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])")


def screen(text: str) -> list[str]:
    """The lines a terminal shows after `text`: \\r, \\n, ESC[2K (erase line), ESC[nA (up); other escape
    sequences (colours, cursor visibility) draw nothing. Trailing empty lines are dropped."""
    lines, row, col = [""], 0, 0
    pos = 0
    while pos < len(text):
        m = _CSI.match(text, pos)
        if m:
            arg, op = m.groups()
            if op == "K":
                lines[row] = ""  # the whole line: rich writes \r before it
            elif op == "A":
                row = max(0, row - int(arg or 1))
            pos = m.end()
            continue
        ch = text[pos]
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row, col = row + 1, 0
            if row == len(lines):
                lines.append("")
        else:
            line = lines[row].ljust(col)
            lines[row] = line[:col] + ch + line[col + 1 :]
            col += 1
        pos += 1
    while lines and not lines[-1].strip():
        lines.pop()
    return lines


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self):
        return True


@pytest.fixture(autouse=True)
def loud():
    progress.set_quiet(False)
    yield
    progress.set_quiet(False)


def test_screen_model():
    """The replay itself, on sequences written out by hand."""
    assert screen("abc\r\x1b[2Kxy") == ["xy"]
    assert screen("one\ntwo\r\x1b[2K\x1b[1A\r\x1b[2Kz") == ["z"]
    assert screen("\x1b[36mab\x1b[0m\n\n") == ["ab"]


def test_a_phase_is_shown_on_a_terminal_and_erased_after():
    term = Terminal()
    seen = []
    with progress.phase("loading weights", stream=term):
        seen.append(screen(term.getvalue()))
        with progress.phase("repacking"):
            time.sleep(0.4)  # a few refreshes
            seen.append(screen(term.getvalue()))
        time.sleep(0.3)
        seen.append(screen(term.getvalue()))
    assert len(seen[0]) == 1 and seen[0][0].endswith("loading weights")  # drawn at once, not at a refresh
    assert len(seen[1]) == 1 and seen[1][0].endswith("loading weights › repacking")
    assert re.fullmatch(r"\S  +\d+ s  loading weights", seen[2][0]), seen[2]
    assert screen(term.getvalue()) == []  # nothing left on the screen
    assert progress._live is None and progress._stack == []


def test_the_label_can_change_and_a_long_line_is_cut_not_wrapped(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # rich's width for a stream that is no real terminal
    term = Terminal()
    with progress.phase("downloading", stream=term) as p:
        p.update("downloading: 42 of 93 MiB " + "x" * 300)
        time.sleep(0.3)
        shown = screen(term.getvalue())
    assert len(shown) == 1 and "42 of 93 MiB" in shown[0] and len(shown[0]) <= 80
    assert shown[0].endswith("…")


def test_nothing_is_printed_when_not_a_terminal_or_quiet():
    plain = io.StringIO()
    with progress.phase("loading weights", stream=plain):
        time.sleep(0.2)
    assert plain.getvalue() == ""
    term = Terminal()
    progress.set_quiet()
    with progress.phase("loading weights", stream=term):
        time.sleep(0.2)
    assert term.getvalue() == ""
    assert not progress.shown(term)


def test_an_error_in_a_phase_ends_the_line_and_propagates():
    term = Terminal()
    with pytest.raises(ValueError, match="bad file"):
        with progress.phase("loading", stream=term):
            raise ValueError("bad file")
    assert screen(term.getvalue()) == [] and progress._live is None


def test_until_first_shows_the_label_until_the_first_item_only():
    term = Terminal()

    def items():
        time.sleep(0.3)  # the compile
        yield from ("The", " capital")

    seen = [(item, screen(term.getvalue())) for item in progress.until_first(items(), "compiling", stream=term)]
    assert [item for item, _ in seen] == ["The", " capital"]
    assert seen[0][1] == []  # the line is gone before the first item is printed
    assert "compiling" in term.getvalue()
    assert list(progress.until_first([], "nothing", stream=term)) == []


@pytest.mark.parametrize(
    "argv, want",
    [
        (["generate", "hi", "--json"], True),
        (["generate", "hi", "--js"], True),  # argparse takes a unique prefix
        (["generate", "hi"], False),
        (["generate", "--jx", "hi"], False),
        (["generate", "--", "--json"], False),  # after "--" it is the prompt
    ],
)
def test_wants_json(argv, want):
    assert _wants_json(argv) is want


def test_importing_the_package_does_not_import_jax():
    """What lets the command show its first line before the seconds of JAX's import."""
    code = "import sys, jaxdecode.__main__; print(sorted({'jax', 'flax', 'rich'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_command_shows_its_first_phase_on_a_terminal_and_not_under_json():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    run = run_on_ptys([sys.executable, "-m", "jaxdecode", "generate", "  "], timeout_s=300, env=env)
    assert run["returncode"] == 2 and run["stdout"] == ""
    assert "starting" in run["stderr"]  # the line drawn before the CLI's imports
    assert screen(run["stderr"]) == ["jaxdecode: error: empty prompt"]  # ... and erased before the error
    run = run_on_ptys([sys.executable, "-m", "jaxdecode", "generate", "  ", "--json"], timeout_s=300, env=env)
    assert run["returncode"] == 2 and run["stdout"] == ""
    assert run["stderr"] == "jaxdecode: error: empty prompt\r\n"  # the pty's line discipline adds \r
