"""`jaxdecode chat`: an interactive chat with an `Engine` and its tokenizer's chat template.

At the prompt: Enter on an empty line does nothing; Ctrl-C drops a typed line, and at an empty prompt ends the
session, as Ctrl-D and /exit do (with a newline, so that the shell's prompt starts on a line of its own).
During a reply, Ctrl-C stops it and returns to the prompt; what was shown of it stays in the conversation.
Line editing and history come from the standard library's `readline`, which `input()` uses once imported: a
third-party line editor would be a dependency for what Python already does (where Python has no readline,
as on Windows, the line is plain).

Each reply streams in chunks of `CHUNK` tokens (`Engine.generate_chunks`, one host sync per chunk). Four
tokens arrive several times a second at a CPU's tens of tokens per second, which reads as a stream, and
Ctrl-C takes effect within one chunk: the interrupt is raised when the device call in flight returns. One
token per chunk would add a host round trip to every step, which a GPU's millisecond steps would notice.

When the conversation no longer fits the model's context with room for --max-new-tokens, the oldest turns
are dropped, and a line says so.
"""

from __future__ import annotations

import sys
from typing import TextIO

from jaxdecode.sampling import SamplingParams
from jaxdecode.tokenizer import Tokenizer, utf8_problem

CHUNK = 4
PROMPT = "> "
HELP = (
    "/clear          forget the conversation (the system prompt stays)\n"
    "/system TEXT    set the system prompt and forget the conversation; /system alone removes it\n"
    "/exit           end the session (also Ctrl-D, or Ctrl-C at an empty prompt)\n"
    "/help           this list\n"
    "Ctrl-C during a reply stops it. A line that starts with a space is sent as text, even ' /like this'."
)


class ChatSession:
    """A conversation with `engine` (an `Engine`, tensor parallel or not) through `tokenizer`'s chat template.

    `run` reads lines with `read` (default `input`) until the user leaves and returns the exit code (0).
    Replies go to `out`; notices (markers, dropped turns, errors) to `err`, one line each, in brackets.
    Turn i of the session samples with seed `seed + i`, so that a repeated question under sampling gets a
    fresh draw while the whole session stays reproducible.
    """

    def __init__(
        self,
        engine,
        tokenizer: Tokenizer,
        *,
        max_new_tokens: int,
        sampling: SamplingParams = SamplingParams(),
        seed: int = 0,
        system: str | None = None,
        read=input,
        out: TextIO | None = None,
        err: TextIO | None = None,
    ):
        self.context = engine.cfg.max_seq_len
        if max_new_tokens >= self.context:
            raise ValueError(
                f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's context of "
                f"{self.context} tokens"
            )
        if not tokenizer.chat_template:
            raise ValueError(f"{tokenizer.source}: no chat template, so no chat; `jaxdecode generate` takes plain text")
        self.engine, self.tok = engine, tokenizer
        self.max_new_tokens, self.sampling, self.seed = max_new_tokens, sampling, seed
        self.system = system
        self.turns: list[tuple[str, str]] = []  # (user, assistant) text, oldest first
        self.replies = 0
        self.read = read
        self.out = out or sys.stdout
        self.err = err or sys.stderr

    # -- the loop ----------------------------------------------------------------------------------

    def run(self) -> int:
        editing = self.read is input and sys.stdin.isatty() and _load_readline()
        print("Chat: /help lists the commands; Ctrl-C stops a reply; Ctrl-D or /exit ends.", file=self.err, flush=True)
        while True:
            try:
                line = self.read(PROMPT)
            except EOFError:
                print(file=self.out, flush=True)
                return 0
            except KeyboardInterrupt:
                print(file=self.out, flush=True)
                if editing and _typed_text():  # Ctrl-C over a typed line drops it, as a shell does
                    continue
                return 0
            except UnicodeDecodeError as e:
                self.say(f"the line is not valid UTF-8 (byte {e.object[e.start]:#04x} at offset {e.start}); not sent")
                continue
            if not self.handle(line):
                return 0

    def handle(self, line: str) -> bool:
        """Act on one input line: a command or a message. False when the session should end."""
        if not line.strip():
            return True
        if problem := utf8_problem(line):
            self.say(f"the line is not valid UTF-8 ({problem}); not sent")
            return True
        if not line.startswith("/"):
            self.reply(line)
            return True
        command, _, rest = line.partition(" ")
        if command == "/exit":
            return False
        if command == "/help":
            print(HELP, file=self.err, flush=True)
        elif command == "/clear":
            self.say(f"forgot {_turns(len(self.turns))}")
            self.turns.clear()
        elif command == "/system":
            self.system = rest.strip() or None
            self.say(f"system prompt {'set' if self.system else 'removed'}; forgot {_turns(len(self.turns))}")
            self.turns.clear()
        else:
            self.say(f"unknown command {command}: /help lists them")
        return True

    def reply(self, user: str) -> None:
        """Stream the model's reply to `user` and keep the turn; Ctrl-C stops the reply and keeps what was shown."""
        shown: list[str] = []
        try:
            fit = self._fit(user)
            if fit is None:
                return
            ids, budget = fit
            eos = set(self.tok.eos_token_ids)
            stream, count, ended = self.tok.stream(), 0, False
            chunks = self.engine.generate_chunks(
                [ids],
                max_new_tokens=budget,
                sampling=self.sampling,
                seed=(self.seed + self.replies) % 2**32,
                eos_ids=tuple(eos),
                chunk=CHUNK,
            )
            self.replies += 1
            try:
                for chunk in chunks:
                    for t in chunk.tokens[0][: budget - count]:
                        count += 1
                        if t < 0 or int(t) in eos:
                            ended = True
                            break
                        self._show(stream.push(int(t)), shown)
                    if ended or count >= budget:
                        break
            finally:
                chunks.close()
            self._show(stream.flush(), shown)
            print(file=self.out, flush=True)
            if not ended:  # finish_reason "length", as jaxdecode.LLM names it
                limit = f"--max-new-tokens {budget}" if budget == self.max_new_tokens else "the end of the context"
                self.say(f"stopped at {limit}")
        except KeyboardInterrupt:
            print(file=self.out, flush=True)
            self.say("stopped by Ctrl-C")
        except ValueError as e:  # the chat template's limits, text it cannot encode, non-finite logits
            print(file=self.out, flush=True)
            self.say(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}; the turn is not kept")
            return
        if shown:
            self.turns.append((user, "".join(shown)))

    # -- pieces ------------------------------------------------------------------------------------

    def messages(self, turns: list[tuple[str, str]], user: str) -> list[dict]:
        """The chat messages for the system prompt, `turns` and the new `user` message."""
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for u, a in turns:
            msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        return msgs + [{"role": "user", "content": user}]

    def _fit(self, user: str) -> tuple[list[int], int] | None:
        """(prompt ids, new-token budget) for the conversation and `user`, the oldest turns dropped while the
        prompt leaves less than --max-new-tokens of the context; None (said) when even `user` alone leaves none."""
        dropped = 0
        while True:
            ids = self.tok.encode_chat(self.messages(self.turns[dropped:], user), add_bos=False)
            room = self.context - len(ids)
            if room >= self.max_new_tokens or dropped == len(self.turns):
                break
            dropped += 1
        if room < 1:  # the conversation stays as it was
            self.say(f"the message takes {len(ids)} of the context's {self.context} tokens; not sent")
            return None
        if dropped:
            del self.turns[:dropped]
            self.say(f"dropped the oldest {_turns(dropped)}: the conversation outgrew the context of {self.context}")
        return ids, min(room, self.max_new_tokens)

    def _show(self, text: str, shown: list[str]) -> None:
        if text:
            shown.append(text)
            print(text, end="", file=self.out, flush=True)

    def say(self, text: str) -> None:
        """One bracketed notice line on `err` (after the reply text already on `out`)."""
        self.out.flush()
        print(f"[{text}]", file=self.err, flush=True)


def _turns(n: int) -> str:
    return f"{n} turn" if n == 1 else f"{n} turns"


def _load_readline() -> bool:
    try:
        import readline  # noqa: F401  (importing it is what gives input() line editing and history)
    except ImportError:
        return False
    return True


def _typed_text() -> str:
    import readline

    return readline.get_line_buffer()
