"""Chat templates rendered in a separate process with a time limit, an output-size limit and a memory cap.

A chat template is code that ships inside a model file. jinja2's sandbox stops it from reaching Python
internals, but not from looping for hours (`range(100000)` nested twice) or building a 4 GB string in
one operation (`'a' * 4000000000`), and no check inside the renderer can stop a single C-level
allocation in time. So templates render in a worker process (this file run as a script: no jax, only
jinja2) whose address space is capped with RLIMIT_AS: the kernel refuses any allocation past the cap
and the template gets a MemoryError, whatever operation made it. The parent waits at most `seconds`
for an answer and kills the worker past that; a worker that died is replaced on the next render.
One worker serves the whole process, started on the first render.

Protocol: one ASCII JSON object per line each way. Request {"template", "context", "max_chars"}; answer
{"text"} or {"error"}. The worker renders with `Template.generate` and stops at `max_chars`.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class TemplateLimits:
    """Bounds on one rendering, far above what a real template needs for a conversation that fits a context."""

    seconds: float = 2.0  # wall time of one rendering (the worker's start is not counted)
    output_chars: int = 1 << 22  # the rendered prompt: 4 Mi characters, past any model's context
    memory_bytes: int = 1 << 29  # address space the worker may grow by past its start (RLIMIT_AS)


class TemplateError(Exception):
    """A rendering failed: the message says why (the template raised, or went past a limit)."""


class _Worker:
    def __init__(self, memory_bytes: int):
        self.memory_bytes = memory_bytes
        self.proc = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), str(memory_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # a crash is reported by the parent in one line, never a traceback
            process_group=0,  # the terminal's Ctrl-C (stopping a chat reply) must not kill the worker too
        )

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def ask(self, request: bytes, seconds: float) -> dict | None:
        """The answer, or None if the worker gave none within `seconds` (killed) or died."""
        self.proc.stdin.write(request)
        self.proc.stdin.flush()
        out, line, deadline = self.proc.stdout, bytearray(), time.monotonic() + seconds
        fd = out.fileno()
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.kill()
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:  # died: a memory cap hit outside Python's reach, a signal
                self.proc.wait()
                return None
            line += chunk
        return json.loads(line)


_lock = threading.Lock()
_worker: _Worker | None = None


def render(template: str, context: dict, limits: TemplateLimits = TemplateLimits()) -> str:
    """`template` rendered with `context` (JSON-like values) within `limits`; TemplateError otherwise."""
    global _worker
    try:
        request = json.dumps({"template": template, "context": context, "max_chars": limits.output_chars})
    except (TypeError, ValueError) as e:
        raise TemplateError(f"the messages are not JSON-like values: {e}") from None
    with _lock:
        if _worker is None or _worker.proc.poll() is not None or _worker.memory_bytes != limits.memory_bytes:
            if _worker is not None and _worker.proc.poll() is None:
                _worker.kill()
            _worker = _Worker(limits.memory_bytes)
            if _worker.ask(b'{"ping": 1}\n', 60.0) is None:  # started and imported jinja2
                raise TemplateError("the template process did not start")
        try:
            answer = _worker.ask(request.encode("ascii") + b"\n", limits.seconds)
        except (BrokenPipeError, ValueError):
            answer = None
        except BaseException:  # Ctrl-C mid-render: its answer would be read as the next render's
            _worker.kill()
            raise
    if answer is None:
        code = _worker.proc.returncode
        if code == -9:
            raise TemplateError(f"rendering took longer than {limits.seconds:g} s")
        raise TemplateError(f"the template process died while rendering (exit code {code})")
    if "error" in answer:
        raise TemplateError(answer["error"])
    return answer["text"]


# --- the worker ---------------------------------------------------------------------------------------


def _cap_memory(extra: int) -> None:
    """RLIMIT_AS = the address space in use now + `extra` (Linux: /proc/self/statm's first field; where
    there is no /proc the worker runs uncapped, bounded by time and output only)."""
    import resource

    try:
        with open("/proc/self/statm") as fh:
            in_use = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    cap = in_use + extra if hard == resource.RLIM_INFINITY else min(in_use + extra, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))


def _environment():
    """A sandboxed environment configured like transformers' (trim_blocks, lstrip_blocks, loop controls,
    `raise_exception`, `tojson`, `strftime_now`)."""
    from datetime import datetime

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class RaisedByTemplate(Exception):
        pass

    def raise_exception(message):
        raise RaisedByTemplate(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env, RaisedByTemplate


def _render_one(env, raised, compiled: dict, request: dict) -> dict:
    from jinja2 import TemplateSyntaxError

    source, max_chars = request["template"], request["max_chars"]
    try:
        if source not in compiled:
            compiled.clear()  # one model's template at a time
            compiled[source] = env.from_string(source)
        pieces, size = [], 0
        for piece in compiled[source].generate(**request["context"]):
            size += len(piece)
            if size > max_chars:
                return {"error": f"the rendered prompt is longer than {max_chars} characters"}
            pieces.append(piece)
        return {"text": "".join(pieces)}
    except raised as e:
        return {"error": f"the template raised an error: {e}"}
    except TemplateSyntaxError as e:
        return {"error": f"does not compile: {e} (line {e.lineno})"}
    except MemoryError:
        return {"error": "rendering needs more memory than the template process may use"}
    except RecursionError:
        return {"error": "rendering recursed too deep"}
    except Exception as e:  # anything a template does wrong is its error, reported in one line
        return {"error": f"{type(e).__name__}: {e}"}


def _serve(memory_bytes: int) -> None:
    env, raised = _environment()
    compiled: dict = {}
    _cap_memory(memory_bytes)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    for line in stdin:
        request = json.loads(line)
        answer = {"pong": 1} if "ping" in request else _render_one(env, raised, compiled, request)
        try:  # ASCII JSON: a lone surrogate in the text travels as an escape
            data = json.dumps(answer).encode("ascii")
        except MemoryError:
            data = b'{"error": "rendering needs more memory than the template process may use"}'
        stdout.write(data + b"\n")
        stdout.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
