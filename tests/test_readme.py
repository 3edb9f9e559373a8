"""README.md's commands: each `jaxdecode ...` line of a shell block runs; its usage block names real flags.

A command runs as written (`uv run [...]` left out: the environment is the test's own, and uv would sync it),
from a scratch directory, with a question on stdin for `chat`; `DIR` is a scratch folder. A command whose
comment says GPU runs where there is one; on the CPU it must refuse: exit code 2, no traceback, the reason in
the last line of stderr. Any other command must succeed and print something that is not usage.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from jaxdecode.cli import build_parser

README = Path(__file__).parents[1] / "README.md"
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
COMMAND_S = 1200  # far above any command's time on 2 shared CPU cores (loading, compiling, a short reply)
ON_CPU = os.environ.get("JAX_PLATFORMS") == "cpu"  # tests/conftest.py sets it unless the run asks for a GPU


def _blocks(*langs: str) -> list[str]:
    return [body for lang, body in BLOCK.findall(README.read_text()) if lang in langs]


def _commands() -> list[tuple[list[str], str]]:
    """(argv after `jaxdecode`, the line's comment) for each command in the bash blocks."""
    found = []
    for body in _blocks("bash", "sh", "shell"):
        for line in body.replace("\\\n", " ").splitlines():
            code, _, comment = line.partition(" # ")  # no README command has " # " inside quotes
            words = shlex.split(code)
            if words[:2] == ["uv", "run"] and "jaxdecode" in words:
                words = words[words.index("jaxdecode") :]
            if words and words[0] == "jaxdecode":
                found.append((words[1:], comment.strip()))
    return found


COMMANDS = _commands()


def test_the_readme_has_commands_for_every_subcommand():
    named = {argv[0] for argv, _ in COMMANDS}
    assert named >= {"generate", "chat", "bench", "loop-report", "rdu", "tune"}, named


@pytest.mark.parametrize("argv, comment", COMMANDS, ids=[" ".join(a)[:60] for a, _ in COMMANDS])
def test_readme_command_runs(argv, comment, tmp_path):
    argv = [str(tmp_path / "out") if a == "DIR" else a for a in argv]
    exe = Path(sys.executable).with_name("jaxdecode")  # the console script the README's `jaxdecode` is
    proc = subprocess.run(
        [str(exe), *argv],
        input="What is the capital of France?\n",
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=COMMAND_S,
    )
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if "GPU" in comment and ON_CPU:
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
        assert proc.returncode == 2 and last, (proc.returncode, proc.stderr[-2000:])
        assert re.search(r"GPU|devices|measured nothing", last), last
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.strip() and not proc.stdout.startswith("usage:"), proc.stdout[-2000:]


def test_usage_block_names_only_real_commands_and_flags():
    """The usage synopsis (a `text` block) is not run: each subcommand it names and each --flag on its line
    (comment included) must exist in the parser."""
    parser = build_parser(complete=True)  # every subcommand's flags, the deferred ones too
    [sub] = [a for a in parser._actions if a.dest == "command"]
    lines = []
    for body in _blocks("text"):
        for line in body.splitlines():
            if line.startswith(" ") and lines:
                lines[-1] += line
            else:
                lines.append(line)
    usage = [line for line in lines if line.startswith("jaxdecode ") and line.split()[1] != "COMMAND"]
    assert len(usage) >= 6
    for line in usage:
        name = line.split()[1]
        assert name in sub.choices, line
        options = {o for a in sub.choices[name]._actions for o in a.option_strings}
        flags = set(re.findall(r"--[a-z][a-z0-9-]*", line))
        assert flags <= options, (name, flags - options)
