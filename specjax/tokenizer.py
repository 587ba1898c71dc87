"""Tokenizers built with the `tokenizers` library, from GGUF metadata or a tokenizer.json.

GGUF "gpt2"-type vocabularies (SmolLM2, Qwen2, Llama-3) are byte-level BPE:
vocab + merges + special tokens in the file's metadata. We rebuild them as a
``tokenizers.Tokenizer`` (BPE model, byte-level pre-tokenizer and decoder) rather
than hand-writing a BPE. Chat templates are Jinja, rendered with jinja2 in a
sandbox.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specjax.errors import SpecjaxError

if TYPE_CHECKING:
    from specjax.models.gguf_file import GGUFFile

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
_SPECIAL_TYPES = (3, 4)

# Pre-tokenizer regexes by GGUF `tokenizer.ggml.pre` (byte-level BPE families).
_GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_QWEN2_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
                r"""|\s+(?!\S)|\s+""")
_LLAMA3_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


@dataclass
class Tokenizer:
    backend: "object"  # tokenizers.Tokenizer
    bos_id: int | None
    eos_ids: tuple[int, ...]
    pad_id: int
    add_bos: bool = False
    chat_template: str | None = None
    special_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, skip_special: bool = True) -> str:
        return self.backend.decode(list(int(i) for i in ids), skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise SpecjaxError("this model's tokenizer has no chat template; run without --chat")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg):
            raise SpecjaxError(f"chat template: {msg}")

        env.globals["raise_exception"] = raise_exception
        tmpl = env.from_string(self.chat_template)
        bos = self.backend.id_to_token(self.bos_id) if self.bos_id is not None else ""
        eos = self.backend.id_to_token(self.eos_ids[0]) if self.eos_ids else ""
        return tmpl.render(messages=messages, add_generation_prompt=add_generation_prompt,
                           bos_token=bos, eos_token=eos)

    def encode_chat(self, user_text: str, system: str | None = None) -> list[int]:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user_text}]
        return self.encode(self.apply_chat_template(msgs), add_bos=False)

    # ------------------------------------------------------------ constructors

    @classmethod
    def from_gguf(cls, reader: GGUFFile) -> "Tokenizer":
        from specjax.models.weights import gguf_field

        model = gguf_field(reader, "tokenizer.ggml.model")
        if model != "gpt2":
            raise SpecjaxError(f"unsupported GGUF tokenizer model {model!r} (supported: gpt2 byte-level BPE)")
        tokens = gguf_field(reader, "tokenizer.ggml.tokens")
        merges = gguf_field(reader, "tokenizer.ggml.merges") or []
        types = gguf_field(reader, "tokenizer.ggml.token_type")
        pre = gguf_field(reader, "tokenizer.ggml.pre", "default")
        specials = {}
        if types is not None:
            specials = {tokens[i]: i for i, t in enumerate(types) if int(t) in _SPECIAL_TYPES}
        bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
        eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
        eot = gguf_field(reader, "tokenizer.ggml.eot_token_id")
        pad = gguf_field(reader, "tokenizer.ggml.padding_token_id", eos)
        eos_ids = tuple(dict.fromkeys(int(x) for x in (eos, eot) if x is not None))
        backend = build_bpe(tokens, merges, specials, pre)
        return cls(backend=backend, bos_id=None if bos is None else int(bos), eos_ids=eos_ids,
                   pad_id=int(pad if pad is not None else 0),
                   add_bos=bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
                   chat_template=gguf_field(reader, "tokenizer.chat_template"), special_tokens=specials)

    @classmethod
    def from_tokenizer_json(cls, path: str, tokenizer_config: str | None = None) -> "Tokenizer":
        """Load a Hugging Face tokenizer.json (and, if given, tokenizer_config.json for
        bos/eos and the chat template)."""
        from tokenizers import Tokenizer as HFTok

        try:
            backend = HFTok.from_file(path)
        except Exception as e:
            raise SpecjaxError(f"cannot load tokenizer {path}: {e}") from None
        conf = {}
        if tokenizer_config:
            with open(tokenizer_config) as f:
                conf = json.load(f)

        def tok_id(v):
            if isinstance(v, dict):
                v = v.get("content")
            return backend.token_to_id(v) if v else None

        bos = tok_id(conf.get("bos_token"))
        eos = tok_id(conf.get("eos_token"))
        specials = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        return cls(backend=backend, bos_id=bos, eos_ids=(eos,) if eos is not None else (),
                   pad_id=tok_id(conf.get("pad_token")) or (eos or 0), add_bos=bool(conf.get("add_bos_token", False)),
                   chat_template=conf.get("chat_template"), special_tokens=specials)


def build_bpe(tokens: list[str], merges: list[str], specials: dict[str, int], pre: str = "default"):
    """A byte-level BPE `tokenizers.Tokenizer` from GGUF-style vocab and merges."""
    from tokenizers import AddedToken, Regex, Tokenizer as HFTok, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
    bpe = models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False, byte_fallback=False)
    tok = HFTok(bpe)
    regex = {"qwen2": _QWEN2_REGEX, "llama-bpe": _LLAMA3_REGEX, "llama3": _LLAMA3_REGEX}.get(pre, _GPT2_REGEX)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # Specials must be added in id order so they keep their GGUF ids.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, _ in sorted(specials.items(), key=lambda kv: kv[1])])
    return tok
