"""Tokenizer and chat template, from GGUF metadata or a Hugging Face tokenizer.json.

GGUF files carry byte-level BPE vocabularies as `tokenizer.ggml.*` arrays; we rebuild them with the
`tokenizers` library, choosing the pre-tokenizer (how text is split before BPE) from
`tokenizer.ggml.pre` as llama.cpp does. Every metadata field read is type- and range-checked, and a
bad one is a `TokenizerError` (a `WeightsError`) naming the key and the file.

Chat templates render in a bounded, sandboxed jinja2 process (`jaxdecode.chat_template`). In a chat
prompt only the template's own markers become control tokens: special-token text inside a message
(a user typing "<|im_end|>") is encoded as plain text (`Tokenizer.encode_chat`).
"""

from __future__ import annotations

import re
import secrets
import threading
from collections.abc import Iterable, Iterator, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from jaxdecode.chat_template import TemplateError, TemplateLimits, render
from jaxdecode.weights.checks import WeightsError, read_json_object, read_text


class TokenizerError(WeightsError):
    """The tokenizer data is missing, malformed or of an unsupported kind, or its chat template failed."""


_MAX_TEMPLATE_CHARS = 1 << 20  # real chat templates are a few kB (tool-use ones tens of kB)
_MAX_TOKENIZER_JSON = 1 << 28  # the largest real tokenizer.json files are tens of MB
_MAX_CONFIG_JSON = 1 << 24


# Pre-tokenizer split patterns, by llama.cpp's `tokenizer.ggml.pre` name.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2 = ("gpt-2", "gpt2", "default", "phi-2", "olmo", "stablelm2", "jais", "poro-chat", "viking")
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_LLAMA3 = ("llama3", "llama-bpe", "llama-v3", "smaug-bpe", "dbrx", "falcon3")
_QWEN2 = ("qwen2", "deepseek-r1-qwen")

# llama.cpp token types.
_CONTROL, _USER_DEFINED = 3, 4
# Special tokens that end a turn when a chat template writes them.
_END_MARK = re.compile(r"end|eot|eom", re.IGNORECASE)


def _pre_tokenizer(pre: str, source: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2:
        return byte_level
    if pre in _DIGITS_THEN_GPT2:  # llama.cpp: "\p{N}" first, then the GPT-2 pattern
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    split = _LLAMA3_SPLIT if pre in _LLAMA3 else _QWEN2_SPLIT if pre in _QWEN2 else None
    if split is None:
        known = ", ".join(_GPT2 + _DIGITS_THEN_GPT2 + _LLAMA3 + _QWEN2)
        raise TokenizerError(f"{source}: unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: {known}")
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _show(value: Any) -> str:
    """A value's repr for an error message, cut to one short line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Fields:
    """Typed reads of tokenizer metadata (a GGUF file's or tokenizer_config.json's): a value of the wrong
    type or range is a TokenizerError naming the key and `source`."""

    def __init__(self, data: dict[str, Any], source: str):
        self.data, self.source = data, source

    def error(self, key: str, want: str, value: Any) -> TokenizerError:
        return TokenizerError(f"{self.source}: {key} must be {want}, got {_show(value)}")

    def get(self, key: str, kind: type, want: str, default: Any = None) -> Any:
        """The value of `key` (None or `default` if absent), an instance of `kind` (bool is no int)."""
        value = self.data.get(key, default)
        if value is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
            raise self.error(key, want, value)
        return value

    def strings(self, key: str) -> list[str] | None:
        value = self.data.get(key)
        if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise self.error(key, "an array of strings", value)
        return value

    def token_id(self, key: str, value: Any, n: int) -> int | None:
        """`value` (read from `key`) as a token id in [0, n), or None when absent."""
        if value is not None and (type(value) is not int or not 0 <= value < n):
            raise self.error(key, f"a token id in [0, {n})", value)
        return value

    def template(self, key: str, value: Any) -> str | None:
        if value is not None and not isinstance(value, str):
            raise self.error(key, "a string (a jinja2 chat template)", value)
        if value is not None and len(value) > _MAX_TEMPLATE_CHARS:
            raise self.error(key, f"at most {_MAX_TEMPLATE_CHARS} characters long", len(value))
        return value


def _hf_token(fields: _Fields, backend: tokenizers.Tokenizer, key: str, n: int) -> int | None:
    """The id of a special token named in tokenizer_config.json: a string or an AddedToken dict, in the vocabulary."""
    value = fields.data.get(key)
    text = value.get("content") if isinstance(value, dict) else value
    if text is None:
        return None
    if not isinstance(text, str):
        raise fields.error(key, 'a token string or {"content": string}', value)
    i = backend.token_to_id(text)
    if i is None:
        raise fields.error(key, "a token of the vocabulary", text)
    return fields.token_id(key, i, n)


class Tokenizer:
    """Text ↔ token ids, special tokens, streaming decode and chat templates.

    `source` names where the tokenizer came from (a file), for error messages; `template_limits` bound
    each chat template rendering (`chat_template.TemplateLimits`)."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_id: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        add_bos: bool = False,
        chat_template: str | None = None,
        extra_eos_ids: Iterable[int] = (),
        source: str = "tokenizer",
        template_limits: TemplateLimits = TemplateLimits(),
    ):
        self.backend, self.source, self.template_limits = backend, source, template_limits
        fields = _Fields({}, source)
        n = self.max_id + 1
        extra = list(extra_eos_ids)
        ids = [("bos_id", bos_id), ("eos_id", eos_id), ("pad_id", pad_id)] + [("extra_eos_ids", i) for i in extra]
        for name, i in ids:
            fields.token_id(name, i, n)
        self.bos_id, self.eos_id, self.pad_id, self.add_bos = bos_id, eos_id, pad_id, bool(add_bos)
        self.chat_template = fields.template("chat_template", chat_template)
        specials = {i: tok.content for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        eos = ([eos_id] if eos_id is not None else []) + extra
        if chat_template:  # the template's end-of-turn marker, e.g. <|im_end|>
            eos += [i for i, text in specials.items() if _END_MARK.search(text) and text in chat_template]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))
        self.special_ids = frozenset(specials)
        # longest first, so that a marker containing another is found whole
        alternatives = sorted({text for text in specials.values() if text}, key=len, reverse=True)
        self._special_text = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None
        self._plain_lock = threading.Lock()

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], source: str = "GGUF metadata") -> Tokenizer:
        """A byte-level BPE tokenizer from GGUF metadata (`tokenizer.ggml.model` == "gpt2"); `source` (the
        file) is named in errors."""
        f = _Fields(metadata, source)
        kind = f.get("tokenizer.ggml.model", str, "a string")
        if kind != "gpt2":
            raise TokenizerError(
                f"{source}: unsupported GGUF tokenizer model {kind!r}; only byte-level BPE ('gpt2') is supported"
            )
        tokens, merges = f.strings("tokenizer.ggml.tokens"), f.strings("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise TokenizerError(f"{source}: GGUF metadata lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
        types = metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))
        if not (isinstance(types, list) and len(types) == len(tokens) and all(type(t) is int for t in types)):
            raise f.error("tokenizer.ggml.token_type", f"an array of {len(tokens)} integers (one per token)", types)
        vocab = {tok: i for i, tok in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        bad = next((i for i, p in enumerate(pairs) if len(p) != 2), None)
        if bad is not None:
            raise f.error(f"tokenizer.ggml.merges[{bad}]", 'a pair "left right"', merges[bad])
        try:
            bpe = models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False)
        except Exception as e:  # the Rust side raises plain Exception on bad merges, over several lines
            raise TokenizerError(f"{source}: bad GGUF BPE vocabulary: {str(e).splitlines()[0]}") from None
        backend = tokenizers.Tokenizer(bpe)
        backend.pre_tokenizer = _pre_tokenizer(f.get("tokenizer.ggml.pre", str, "a string", "default"), source)
        backend.decoder = decoders.ByteLevel()
        backend.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
        )
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL]
        )
        n = len(tokens)
        ids = {k: f.token_id(k, metadata.get(k), n) for k in (f"tokenizer.ggml.{x}_token_id" for x in _GGUF_IDS)}
        return cls(
            backend,
            bos_id=ids["tokenizer.ggml.bos_token_id"],
            eos_id=ids["tokenizer.ggml.eos_token_id"],
            pad_id=ids["tokenizer.ggml.padding_token_id"],
            add_bos=f.get("tokenizer.ggml.add_bos_token", bool, "true or false", False),
            chat_template=f.template("tokenizer.chat_template", metadata.get("tokenizer.chat_template")),
            extra_eos_ids=[i for k in ("eot", "eom") if (i := ids[f"tokenizer.ggml.{k}_token_id"]) is not None],
            source=source,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """From a HF directory: tokenizer.json, plus tokenizer_config.json and generation_config.json if present."""
        d = Path(path)
        text = read_text(d / "tokenizer.json", "tokenizer.json", _MAX_TOKENIZER_JSON)
        try:
            backend = tokenizers.Tokenizer.from_str(text)
        except Exception as e:  # tokenizers raises plain Exception for malformed files
            raise TokenizerError(f"{d / 'tokenizer.json'}: cannot load: {e}") from None
        n = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        paths = {name: d / name for name in ("tokenizer_config.json", "generation_config.json", "chat_template.jinja")}
        conf = (
            read_json_object(paths["tokenizer_config.json"], _MAX_CONFIG_JSON, TokenizerError)
            if paths["tokenizer_config.json"].exists()
            else {}
        )
        gen = (
            read_json_object(paths["generation_config.json"], _MAX_CONFIG_JSON, TokenizerError)
            if paths["generation_config.json"].exists()
            else {}
        )
        f, g = _Fields(conf, str(paths["tokenizer_config.json"])), _Fields(gen, str(paths["generation_config.json"]))
        bos_id = _hf_token(f, backend, "bos_token", n)
        template = conf.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        template = f.template("chat_template", template)
        if template is None and paths["chat_template.jinja"].exists():
            template = f.template("chat_template.jinja", read_text(paths["chat_template.jinja"], "template", 1 << 20))
        add_bos = f.get("add_bos_token", bool, "true or false")
        if add_bos is None:  # a post-processor that writes BOS (Llama 3 style) means the model expects one
            add_bos = bos_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]
        gen_eos = gen.get("eos_token_id")
        gen_eos = gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]
        return cls(
            backend,
            bos_id=bos_id,
            eos_id=_hf_token(f, backend, "eos_token", n),
            pad_id=_hf_token(f, backend, "pad_token", n),
            add_bos=add_bos,
            chat_template=template,
            extra_eos_ids=[g.token_id("eos_token_id", i, n) for i in gen_eos],
            source=str(d),
        )

    # --- encode and decode ----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def max_id(self) -> int:
        """The largest id the tokenizer can produce (ids may be sparse: it can exceed vocab_size - 1)."""
        return max(self.backend.get_vocab(with_added_tokens=True).values(), default=-1)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids for `text`; special-token text such as "<|im_start|>" maps to its id. BOS per the file."""
        ids = self.backend.encode(_checked_text(text), add_special_tokens=False).ids
        return self._with_bos(ids, add_bos)

    def _with_bos(self, ids: list[int], add_bos: bool | None) -> list[int]:
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            return [self.bos_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def stream(self, skip_special: bool = True) -> StreamDecoder:
        """A decoder that turns tokens, one at a time, into complete new text."""
        return StreamDecoder(self, skip_special)

    # --- chat -----------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}]), rendered by the model's template
        within `template_limits`. To encode a chat, use `encode_chat`: encoding this text would turn
        special-token text inside a message into control tokens."""
        if not self.chat_template:
            raise TokenizerError(f"{self.source}: no chat template (tokenizer.chat_template / chat_template)")
        special = {
            f"{k}_token": self.token(i) if i is not None else None
            for k, i in (("bos", self.bos_id), ("eos", self.eos_id), ("pad", self.pad_id))
        }
        context = {"messages": list(messages), "add_generation_prompt": add_generation_prompt} | special | kwargs
        try:
            return render(self.chat_template, context, self.template_limits)
        except TemplateError as e:
            raise TokenizerError(f"chat template of {self.source}: {e}") from None

    def encode_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        add_bos: bool | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of the chat prompt for `messages`: the template's markers become control tokens, and
        special-token text inside the messages is plain text (as HF's `split_special_tokens` and llama.cpp
        do for user input), so a message cannot forge a turn.

        Each special-token string in a message is swapped for a marker made of a per-call random number
        (digits and private-use characters, which no case or whitespace filter changes) before rendering;
        the rendered text is split at the control tokens the tokenizer finds, all of them the template's,
        and each piece between them, its markers restored, is encoded with special tokens read as text
        (what the tokenizer does itself: it splits at added tokens before it pre-tokenizes).
        """
        nonce = f"{secrets.randbits(53):016d}"
        forged: list[str] = []

        def hide(value: Any) -> Any:
            if isinstance(value, str):
                if self._special_text is None:
                    return _checked_text(value)
                return self._special_text.sub(lambda m: _mark(nonce, forged, m.group()), _checked_text(value))
            if isinstance(value, dict):
                return {k: hide(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [hide(v) for v in value]
            return value

        text = self.apply_chat_template([hide(m) for m in messages], add_generation_prompt, **kwargs)
        if not forged:  # nothing to keep apart: the tokenizer's own pass (a Metaspace "first" prefix differs by piece)
            return self.encode(text, add_bos)
        marks = re.compile(f"\ue000{nonce}(\\d+)\ue001")
        restore = lambda piece: marks.sub(lambda m: forged[int(m.group(1))], piece)  # noqa: E731
        encoding = self.backend.encode(text, add_special_tokens=False)
        ids, start = [], 0
        for i, (a, b) in zip(encoding.ids, encoding.offsets):
            if i in self.special_ids:
                ids += self._encode_plain(restore(text[start:a])) + [i]
                start = b
        return self._with_bos(ids + self._encode_plain(restore(text[start:])), add_bos)

    def _encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` with special-token strings read as text (`encode_special_tokens`)."""
        if not text:
            return []
        with self._plain_lock:
            self.backend.encode_special_tokens = True
            try:
                return self.backend.encode(text, add_special_tokens=False).ids
            finally:
                self.backend.encode_special_tokens = False


_GGUF_IDS = ("bos", "eos", "padding", "eot", "eom")


def _mark(nonce: str, forged: list[str], text: str) -> str:
    forged.append(text)
    return f"\ue000{nonce}{len(forged) - 1}\ue001"


def _checked_text(text: str) -> str:
    """`text`, if it is a str that is valid Unicode; a ValueError naming the first bad character otherwise.
    A lone surrogate is what Python makes of undecodable bytes (surrogateescape), e.g. in argv."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    problem = utf8_problem(text)
    if problem:
        raise ValueError(f"text is not valid UTF-8: {problem}")
    return text


def utf8_problem(text: str) -> str | None:
    """Where `text` cannot be encoded as UTF-8 ("byte 0xff at character 2": a lone surrogate is what Python
    makes of an undecodable byte, in argv or stdin), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        ch = ord(text[e.start])
        what = f"byte {ch - 0xDC00:#04x}" if 0xDC80 <= ch <= 0xDCFF else f"lone surrogate U+{ch:04X}"
        return f"{what} at character {e.start}"
    return None


class StreamDecoder:
    """Incremental detokenization: `push` returns only text that is complete.

    A multi-byte UTF-8 character split across tokens decodes to U+FFFD until its last byte arrives, and
    byte-level BPE needs context, so each push decodes a short window of recent tokens and returns the
    part past what was already returned.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self.tok, self.skip = tokenizer, skip_special
        self.ids: list[int] = []
        self.prefix = 0  # start of the decode window
        self.read = 0  # tokens before this index have been returned as text

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        done = self.tok.decode(self.ids[self.prefix : self.read], self.skip)
        text = self.tok.decode(self.ids[self.prefix :], self.skip)
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done) :]

    def flush(self) -> str:
        """Whatever is left (an incomplete character comes out as U+FFFD)."""
        done = self.tok.decode(self.ids[self.prefix : self.read], self.skip)
        text = self.tok.decode(self.ids[self.prefix :], self.skip)
        self.prefix = self.read = len(self.ids)
        return text[len(done) :]

    def __call__(self, ids: Iterable[int]) -> Iterator[str]:
        """Yield the new text of each token of `ids` that completes some (then the rest at the end)."""
        for i in ids:
            if piece := self.push(i):
                yield piece
        if rest := self.flush():
            yield rest
