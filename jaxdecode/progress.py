"""A progress line on stderr for the phases that take seconds: imports, loading, packing, compiling, bench rows.

    with phase("loading weights"):
        ...

shows a spinner, the phase (a nested phase after a "›") and the seconds it has run, on one line that is
erased when the outermost phase ends, so that what a command prints afterwards starts on a clean line.
Nothing is printed when stderr is not a terminal or after `set_quiet()` (the CLI's --json). Only the
standard library is imported here; rich is imported when a line is first shown, so that a command can show
its first line before its own imports, which take seconds on a small CPU.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

_quiet = False
_stack: list[Phase] = []  # the phases shown, outermost first
_live: Any = None  # rich.live.Live while a line is shown


class Phase:
    """A phase's label, which the block may change (`with phase(...) as p: p.update("42 of 93 MB")`)."""

    def __init__(self, label: str):
        self.label, self.start = label, time.perf_counter()

    def update(self, label: str) -> None:
        self.label = label


def set_quiet(quiet: bool = True) -> None:
    """Turn the progress line off (or on again) for this process."""
    global _quiet
    _quiet = quiet


def shown(stream=None) -> bool:
    """Whether a phase would be shown on `stream` (default: sys.stderr): not quiet, and a terminal."""
    stream = sys.stderr if stream is None else stream
    if _quiet:
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class _Line:
    """The line: a spinner, the seconds in the innermost phase, the phases' labels (read at each refresh),
    cut to the terminal's width: a line that wrapped would leave its first half behind at each refresh."""

    def __init__(self):
        from rich.spinner import Spinner

        self.spinner = Spinner("dots", style="cyan")

    def __rich_console__(self, console, options):
        from rich.text import Text

        stack = list(_stack)  # the refresh thread reads while the main thread pushes and pops
        if stack:
            seconds = time.perf_counter() - stack[-1].start
            label = " › ".join(p.label for p in stack)
            frame = self.spinner.render(console.get_time())
            yield Text.assemble(frame, f" {seconds:3.0f} s  ", (label, "bold"), no_wrap=True, overflow="ellipsis")


@contextmanager
def phase(label: str, *, stream=None) -> Iterator[Phase]:
    """Show `label` on the progress line while the block runs (see the module docstring); the block gets
    the `Phase`, to update its label. `stream`: where to draw (default sys.stderr)."""
    global _live
    current = Phase(label)
    if _live is None and not shown(stream):
        yield current
        return
    _stack.append(current)
    outermost = _live is None
    if outermost:
        from rich.console import Console
        from rich.live import Live

        console = Console(file=stream) if stream is not None else Console(stderr=True)
        # stdout stays where it is: rich would send what it redirects to the line's stream, stderr
        _live = Live(_Line(), console=console, transient=True, refresh_per_second=8, redirect_stdout=False)
        _live.start(refresh=True)  # the first line now, not after a refresh interval
    try:
        yield current
    finally:
        _stack.pop()
        if outermost:
            live, _live = _live, None
            live.stop()


def until_first[T](items: Iterable[T], label: str, *, stream=None) -> Iterator[T]:
    """`items`, with `label` shown until the first item is there (a stream whose first item takes the
    compile): the line is gone before the caller prints that item."""
    it = iter(items)
    with phase(label, stream=stream):
        try:
            first = next(it)
        except StopIteration:
            return
    yield first
    yield from it
