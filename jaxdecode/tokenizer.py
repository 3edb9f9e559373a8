"""Tokenizer and chat template, from GGUF metadata or a Hugging Face tokenizer.json.

GGUF files carry byte-level BPE vocabularies as `tokenizer.ggml.*` arrays; we rebuild them with the
`tokenizers` library, choosing the pre-tokenizer (how text is split before BPE) from
`tokenizer.ggml.pre` as llama.cpp does. Chat templates are rendered with a sandboxed jinja2
environment configured like transformers' (trim_blocks, lstrip_blocks, `raise_exception`, `tojson`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers


class TokenizerError(ValueError):
    """The tokenizer data is missing, malformed or of an unsupported kind."""


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


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2:
        return byte_level
    if pre in _DIGITS_THEN_GPT2:  # llama.cpp: "\p{N}" first, then the GPT-2 pattern
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    split = _LLAMA3_SPLIT if pre in _LLAMA3 else _QWEN2_SPLIT if pre in _QWEN2 else None
    if split is None:
        known = ", ".join(_GPT2 + _DIGITS_THEN_GPT2 + _LLAMA3 + _QWEN2)
        raise TokenizerError(f"unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: {known}")
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


class Tokenizer:
    """Text ↔ token ids, special tokens, streaming decode and chat templates."""

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
    ):
        self.backend = backend
        self.bos_id, self.eos_id, self.pad_id, self.add_bos = bos_id, eos_id, pad_id, add_bos
        self.chat_template = chat_template
        eos = [eos_id] if eos_id is not None else []
        eos += list(extra_eos_ids)
        if chat_template:  # the template's end-of-turn marker, e.g. <|im_end|>
            for i, tok in backend.get_added_tokens_decoder().items():
                if tok.special and _END_MARK.search(tok.content) and tok.content in chat_template:
                    eos.append(i)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos))

    # --- construction ---------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any]) -> Tokenizer:
        """A byte-level BPE tokenizer from GGUF metadata (`tokenizer.ggml.model` == "gpt2")."""
        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(
                f"unsupported GGUF tokenizer model {kind!r}; only byte-level BPE ('gpt2') is supported"
            )
        tokens = metadata.get("tokenizer.ggml.tokens")
        merges = metadata.get("tokenizer.ggml.merges")
        types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens or ())
        if not (isinstance(tokens, list) and isinstance(merges, list) and len(types) == len(tokens)):
            raise TokenizerError("GGUF metadata lacks tokenizer.ggml.tokens / merges / token_type (or they disagree)")
        vocab = {tok: i for i, tok in enumerate(tokens)}
        try:
            pairs = [tuple(m.split(" ", 1)) for m in merges]
            bpe = models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False)
        except Exception as e:  # the Rust side raises plain Exception on bad merges
            raise TokenizerError(f"bad GGUF BPE vocabulary: {e}") from None
        backend = tokenizers.Tokenizer(bpe)
        backend.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
        backend.decoder = decoders.ByteLevel()
        backend.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
        )
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL]
        )
        get = metadata.get
        extra = [get(k) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if get(k) is not None]
        return cls(
            backend,
            bos_id=get("tokenizer.ggml.bos_token_id"),
            eos_id=get("tokenizer.ggml.eos_token_id"),
            pad_id=get("tokenizer.ggml.padding_token_id"),
            add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),
            chat_template=get("tokenizer.chat_template"),
            extra_eos_ids=extra,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """From a HF directory: tokenizer.json, plus tokenizer_config.json and generation_config.json if present."""
        d = Path(path)
        try:
            backend = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as e:  # tokenizers raises plain Exception for missing or malformed files
            raise TokenizerError(f"{d / 'tokenizer.json'}: cannot load: {e}") from None
        conf, gen = {}, {}
        for name, target in (("tokenizer_config.json", conf), ("generation_config.json", gen)):
            if (d / name).exists():
                try:
                    target.update(json.loads((d / name).read_text(encoding="utf-8")))
                except (ValueError, OSError, TypeError) as e:
                    raise TokenizerError(f"{d / name}: not a valid JSON object: {e}") from None
        bos_tok, eos_tok = _token_text(conf.get("bos_token")), _token_text(conf.get("eos_token"))
        bos_id = backend.token_to_id(bos_tok) if bos_tok else None
        template = conf.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if template is None and (d / "chat_template.jinja").exists():
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        if "add_bos_token" in conf:
            add_bos = bool(conf["add_bos_token"])
        else:  # a post-processor that writes BOS (Llama 3 style) means the model expects one
            add_bos = bos_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]
        gen_eos = gen.get("eos_token_id")
        extra = [gen_eos] if isinstance(gen_eos, int) else [i for i in gen_eos or [] if isinstance(i, int)]
        pad_tok = _token_text(conf.get("pad_token"))
        return cls(
            backend,
            bos_id=bos_id,
            eos_id=backend.token_to_id(eos_tok) if eos_tok else None,
            pad_id=backend.token_to_id(pad_tok) if pad_tok else None,
            add_bos=add_bos,
            chat_template=template,
            extra_eos_ids=extra,
        )

    # --- encode and decode ----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids for `text`; special-token text such as "<|im_start|>" maps to its id. BOS per the file."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def stream(self, skip_special: bool = True) -> StreamDecoder:
        """A decoder that turns tokens, one at a time, into complete new text."""
        return StreamDecoder(self, skip_special)

    # --- chat -----------------------------------------------------------------------------------

    @cached_property
    def _template(self):
        if not self.chat_template:
            raise TokenizerError("this tokenizer has no chat template (tokenizer.chat_template / chat_template)")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template)
        except TemplateError as e:
            raise TokenizerError(f"chat template does not compile: {e}") from None

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}]), rendered by the model's template."""
        from jinja2 import TemplateError

        special = {
            f"{k}_token": self.token(i) if i is not None else None
            for k, i in (("bos", self.bos_id), ("eos", self.eos_id), ("pad", self.pad_id))
        }
        try:
            return self._template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **(special | kwargs)
            )
        except TemplateError as e:
            raise TokenizerError(f"chat template error: {e}") from None


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
