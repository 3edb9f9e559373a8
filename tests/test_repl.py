"""`jaxdecode chat` (jaxdecode/repl.py): the conversation it keeps, its markers and commands, against token ids
written out by hand with a scripted engine; and the real command in a terminal (a pty) on the shipped model."""

import fcntl
import io
import os
import re
import select
import subprocess
import sys
import termios
import time

import numpy as np
import pytest
from helpers import SMOLLM_TOKENS, random_hf_state, write_gguf

from jaxdecode.cli import main
from jaxdecode.config import ModelConfig
from jaxdecode.decode import Chunk
from jaxdecode.loading import load_model
from jaxdecode.repl import CHUNK, ChatSession

# Roles are left out: the test vocabulary (SMOLLM_TOKENS) has no letters for them.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>{% endif %}"
)
START, END, A, B, AB = 1, 2, 3, 4, 5  # <|im_start|>, <|im_end|> (the end token), "a", "b", "ab"
INTERRUPT = None  # in a scripted reply: Ctrl-C arrives while the device computes this chunk


def turn(*ids):
    """A message's ids under TEMPLATE."""
    return [START, *ids, END]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    cfg = ModelConfig("tiny-repl", len(SMOLLM_TOKENS), 48, 2, 4, 2, 80, max_seq_len=64)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, cfg, random_hf_state(cfg), meta={"tokenizer.chat_template": TEMPLATE})
    return load_model(str(path)).tokenizer


class ScriptedEngine:
    """`Engine.generate_chunks` with scripted replies: the first chunk holds one token, then `chunk` at a time,
    exactly max_new_tokens in all, -1 after the end token; a reply shorter than asked continues with "a"."""

    def __init__(self, context: int, replies):
        self.cfg = type("Cfg", (), {"max_seq_len": context})
        self.replies = list(replies)
        self.calls = []  # (prompt ids, max_new_tokens, seed, chunk)

    def generate_chunks(self, prompts, *, max_new_tokens, sampling, seed, eos_ids, chunk):
        self.calls.append((list(prompts[0]), max_new_tokens, seed, chunk))
        script = self.replies.pop(0)
        script = script + [A] * (max_new_tokens - len(script))
        tokens, ended = [], False
        for t in script[:max_new_tokens]:
            tokens.append(-1 if ended else t)
            ended = ended or t in eos_ids
        bounds = [0, 1, *range(1 + chunk, max_new_tokens, chunk), max_new_tokens]
        for lo, hi in zip(bounds, bounds[1:]):
            if INTERRUPT in tokens[lo:hi]:
                raise KeyboardInterrupt
            yield Chunk(np.array([tokens[lo:hi]]))


def session(tok, lines, replies, *, context=64, max_new_tokens=4, **kwargs):
    """Run a session over scripted input `lines` (an exception instance is raised in place of a line; EOF after
    the last); returns (exit code, transcript of replies and notices, the engine)."""
    engine, transcript, feed = ScriptedEngine(context, replies), io.StringIO(), iter(lines)

    def read(prompt):
        transcript.write(prompt)
        line = next(feed, EOFError())
        if isinstance(line, BaseException):
            raise line
        transcript.write(line + "\n")
        return line

    chat = ChatSession(engine, tok, max_new_tokens=max_new_tokens, read=read, out=transcript, err=transcript, **kwargs)
    code = chat.run()
    return code, transcript.getvalue(), engine


def test_turns_are_kept_and_each_reply_says_how_it_ended(tok):
    code, text, engine = session(tok, ["aaaa", "b"], [[AB, AB, END], [B, B, B, B]], seed=7)
    assert code == 0
    assert [c[0] for c in engine.calls] == [
        [*turn(A, A, A, A), START],
        [*turn(A, A, A, A), *turn(AB, AB), *turn(B), START],  # the reply "abab" re-encodes as two tokens
    ]
    assert [c[1:] for c in engine.calls] == [(4, 7, CHUNK), (4, 8, CHUNK)]  # the budget; seed + turn
    assert "> aaaa\nabab\n> b\nbbbb\n[stopped at --max-new-tokens 4]\n> \n" in text
    assert text.endswith("> \n")  # Ctrl-D: a newline, so that the shell's prompt starts on its own line


def test_commands_and_empty_lines(tok):
    lines = ["", "   ", "/help", "a", "/system b", "a", "/clear", "/system", "a", "/bogus x", "/exit", "a"]
    code, text, engine = session(tok, lines, [[B, END]] * 3)
    assert code == 0
    assert [c[0] for c in engine.calls] == [
        [*turn(A), START],
        [*turn(B), *turn(A), START],  # the system message first; the earlier turn forgotten
        [*turn(A), START],  # /clear forgot the turn and /system alone the system prompt
    ]
    assert "/clear " in text and "/system TEXT " in text  # the /help list
    for notice in (
        "[system prompt set; forgot 1 turn]",
        "> /clear\n[forgot 1 turn]\n",
        "[system prompt removed; forgot 0 turns]",
        "[unknown command /bogus: /help lists them]",
    ):
        assert notice in text
    assert "> \n> \n> /help\n" in text.replace("   ", "")  # an empty Enter only shows the prompt again
    assert text.endswith("> /exit\n")  # the line after /exit is never read


def test_oldest_turns_dropped_when_the_context_is_outgrown(tok):
    four = "aaaa"
    lines = [four, four, four, "a" * 40, "a" * 27]
    code, text, engine = session(tok, lines, [[A] * 4, [A] * 4, [A, END], [A, A]], context=32)
    prompts = [c[0] for c in engine.calls]
    # the third prompt would be 6+6+6+6+6+1 = 31 tokens, leaving 1 of the 4 new tokens: the first turn goes
    assert prompts[2] == [*turn(A, A, A, A), *turn(A, A, A, A), *turn(A, A, A, A), START]
    assert text.count("[dropped the oldest 1 turn: the conversation outgrew the context of 32]") == 1
    # 40 a's take 43 tokens alone: refused, and the conversation stays
    assert "[the message takes 43 of the context's 32 tokens; not sent]" in text
    # 27 a's take 30 tokens alone: both kept turns go, and the reply gets the 2 tokens left
    assert "[dropped the oldest 2 turns: the conversation outgrew the context of 32]" in text
    assert prompts[3] == [*turn(*[A] * 27), START] and engine.calls[3][1] == 2
    assert text.endswith("aa\n[stopped at the end of the context]\n> \n") and code == 0


def test_ctrl_c_stops_a_reply_and_keeps_the_session(tok):
    lines = ["a", "b", "ab", KeyboardInterrupt()]
    replies = [[B, A, INTERRUPT], [INTERRUPT], [A, END]]
    code, text, engine = session(tok, lines, replies, max_new_tokens=8)
    assert "> a\nb\n[stopped by Ctrl-C]\n> b\n\n[stopped by Ctrl-C]\n> ab\na\n> \n" in text
    # what was shown of the stopped reply stays; a reply stopped before any text leaves no turn
    assert engine.calls[2][0] == [*turn(A), *turn(B), *turn(AB), START]
    assert code == 0 and text.endswith("> \n")  # Ctrl-C at the empty prompt ends the session


def test_bad_input_lines_are_refused_and_the_session_goes_on(tok):
    code, text, engine = session(tok, ["a\udcff", "a"], [[B, END]])
    assert "[the line is not valid UTF-8 (byte 0xff at character 1); not sent]" in text
    assert [c[0] for c in engine.calls] == [[*turn(A), START]] and code == 0


def test_a_session_needs_room_and_a_chat_template(tok, tmp_path, capsys):
    with pytest.raises(ValueError, match="--max-new-tokens 64 leaves no room"):
        ChatSession(ScriptedEngine(64, []), tok, max_new_tokens=64)
    cfg = ModelConfig("tiny-plain", len(SMOLLM_TOKENS), 48, 2, 4, 2, 80, max_seq_len=64)
    plain = write_gguf(tmp_path / "plain.gguf", cfg, random_hf_state(cfg))
    assert main(["chat", "--model", str(plain), "--max-new-tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no chat template" in err, err


# -- the real command in a terminal ----------------------------------------------------------------------

STEP_S = 300  # loading and compiling the shipped model on 2 shared CPU cores, far above its usual time
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")


# Makes the pty the new session's controlling terminal, then becomes the command: done in the child's own
# Python, because a preexec_fn would fork this multithreaded (JAX) process with Python code to run.
CONTROLLING_TTY = (
    "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); os.execv(sys.argv[1], sys.argv[1:])"
)


class Terminal:
    """A process on the slave side of a pty, its controlling terminal (so \\x03 sends it SIGINT)."""

    def __init__(self, argv):
        self.fd, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, b"\x00\x18\x00\x78\x00\x00\x00\x00")  # 24 x 120
        env = dict(os.environ, TERM="xterm", COLUMNS="120")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CONTROLLING_TTY, *argv],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            start_new_session=True,
        )
        os.close(slave)
        self.buf = b""

    def send(self, data: bytes):
        os.write(self.fd, data)

    def expect(self, pattern: bytes, timeout: float = STEP_S) -> str:
        """Read until `pattern` matches (escape sequences removed); return the text up to the match's end."""
        end = time.monotonic() + timeout
        while not (m := re.search(pattern, self.buf, re.S)):
            left = end - time.monotonic()
            assert left > 0, f"timed out waiting for {pattern!r}; got {self.buf[-2000:]!r}"
            if select.select([self.fd], [], [], min(left, 1.0))[0]:
                try:
                    data = os.read(self.fd, 1 << 16)
                except OSError:  # EIO: the process closed the terminal
                    data = b""
                assert data, f"the process ended waiting for {pattern!r}; got {self.buf[-2000:]!r}"
                self.buf = ANSI.sub(b"", self.buf + data)
        out, self.buf = self.buf[: m.end()], self.buf[m.end() :]
        return out.decode()

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        os.close(self.fd)


PROMPT = rb"\r\n> $"


def test_chat_in_a_terminal():
    """Two turns (the first answers, the second hits the token limit), Ctrl-C in the middle of a third reply,
    /clear, the first question again (the same greedy reply as in a fresh session), Ctrl-C over a typed line,
    /exit. Greedy decoding on the shipped model, 64 new tokens a reply: the Ctrl-C must land while the
    third reply is still streaming, and 8 tokens on a fast CPU could end before the test's Ctrl-C did."""
    term = Terminal([sys.executable, "-m", "jaxdecode.cli", "chat", "--max-new-tokens", "64"])
    try:
        assert "/help lists the commands" in term.expect(PROMPT)
        term.send(b"\r")
        assert term.expect(PROMPT) == "\r\n> "  # an empty Enter: only a new prompt

        question = "What is the capital of France?"
        term.send(question.encode() + b"\r")
        first = term.expect(PROMPT)
        assert "Paris" in first and "[stopped" not in first, first

        term.send(b"Write a long poem about the sea.\r")
        assert "[stopped at --max-new-tokens 64]" in term.expect(PROMPT)

        term.send(b"Tell me a story.\r")
        term.expect(rb"story\.\r\n")
        term.expect(rb"\S")  # the reply has begun: the first of its 64 tokens is on the screen
        term.send(b"\x03")
        assert "[stopped by Ctrl-C]" in term.expect(PROMPT)

        term.send(b"/clear\r")
        assert "[forgot 3 turns]" in term.expect(PROMPT)  # the stopped reply's turn was kept, then forgotten
        term.send(question.encode() + b"\r")
        assert term.expect(PROMPT) == first  # the session is alive and its conversation fresh

        term.send(b"abc")
        term.expect(b"abc")
        # CPython's readline notices a SIGINT only while it waits in select(); one that lands while it is
        # still handling the last key (just after echoing it) stays pending until the next key. A person
        # cannot type that fast; the test waits until readline is back in select().
        time.sleep(0.5)
        term.send(b"\x03")  # over a typed line: the line goes, the session stays
        term.expect(PROMPT)
        term.send(b"/exit\r")
        assert term.proc.wait(timeout=60) == 0
    finally:
        term.close()
