"""Start-up time of the quick-start command, as a user at a terminal sees it.

`python -m jaxdecode.bench.startup [--compile-cache DIR] [--runs N]` runs
`jaxdecode generate "What is the capital of France?" --chat` (the console script beside this Python) with
its stdout and stderr each on a pseudo-terminal, and reports per run the seconds from the start to the
first visible byte (either stream: a progress line counts) and to the first streamed token (stdout
after any echo of the prompt), then one JSON line. The load average is printed with it, because other
processes on the machine inflate every number.
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "What is the capital of France?"


def quick_start_command(extra: list[str]) -> list[str]:
    """The console script of this environment, generating the quick-start answer."""
    return [str(Path(sys.executable).parent / "jaxdecode"), "generate", PROMPT, "--chat", *extra]


def run_on_ptys(command: list[str], timeout_s: float = 600.0, env: dict | None = None) -> dict:
    """Run `command` with stdout and stderr on two pseudo-terminals, read as it writes: its exit code,
    both texts, and the seconds to the first visible byte, to the first token (the first stdout bytes
    that are not the prompt's echo) and to the exit."""
    out_master, out_slave = pty.openpty()
    err_master, err_slave = pty.openpty()
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out_slave, stderr=err_slave, env=env)
    os.close(out_slave)
    os.close(err_slave)
    first_visible = first_token = None
    texts = {out_master: b"", err_master: b""}
    open_fds = set(texts)
    echo = PROMPT.encode()
    while open_fds and time.perf_counter() - start < timeout_s:
        for fd in select.select(list(open_fds), [], [], 0.05)[0]:
            try:
                data = os.read(fd, 65536)
            except OSError:  # the pty reads EIO once the child has closed its side
                data = b""
            if not data:
                open_fds.discard(fd)
                continue
            now = time.perf_counter() - start
            first_visible = now if first_visible is None else first_visible
            texts[fd] += data
            if fd == out_master and first_token is None and texts[fd].replace(echo, b"").strip():
                first_token = now
    if open_fds:
        proc.kill()
    proc.wait()
    for fd in texts:
        os.close(fd)
    return {
        "returncode": proc.returncode,
        "first_visible_s": None if first_visible is None else round(first_visible, 2),
        "first_token_s": None if first_token is None else round(first_token, 2),
        "exit_s": round(time.perf_counter() - start, 2),
        "stdout": texts[out_master].decode(errors="replace"),
        "stderr": texts[err_master].decode(errors="replace"),
    }


def time_start_up(command: list[str]) -> dict:
    """`run_on_ptys` of the quick-start command; RuntimeError unless it exits 0."""
    run = run_on_ptys(command)
    if run["returncode"]:
        raise RuntimeError(f"{command[0]} exited {run['returncode']}: {run['stderr'][-2000:]}")
    return {k: run[k] for k in ("first_visible_s", "first_token_s", "exit_s")} | {"stdout": run["stdout"].strip()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxdecode.bench.startup", description=__doc__.splitlines()[0])
    parser.add_argument("--compile-cache", metavar="DIR", default=None, help="pass --compile-cache DIR to the command")
    parser.add_argument("--runs", type=int, default=1, help="runs in a row (default 1)")
    args = parser.parse_args(argv)
    extra = ["--compile-cache", args.compile_cache] if args.compile_cache else []
    command = quick_start_command(extra)
    rows = []
    for i in range(args.runs):
        load = os.getloadavg()[0]
        row = {"run": i + 1, "load_avg_1min": round(load, 2), **time_start_up(command)}
        rows.append(row)
        print(
            f"run {row['run']}: first visible {row['first_visible_s']} s, first token {row['first_token_s']} s, "
            f"exit {row['exit_s']} s (load average {load:.2f} on {os.cpu_count()} cores)",
            file=sys.stderr,
        )
    print(json.dumps({"command": command[1:], "cpus": os.cpu_count(), "runs": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
