"""What every generation path returns, and the one request schema they all check.

The schema is strict so that nothing that can raise reaches the device: every field is checked
for type and range on the host, with a message naming the field. A bool is not an integer, a
float is never an integer (2.9 and 3.0 alike), NaN and infinities are rejected, and integers are
bounded by what the device arrays hold (int32 counts, uint32 seeds). The Python API
(``SamplingParams``, ``validate_request``) and the JSONL job layer (``specjax.jobs``) both use
the checks here. This module imports no JAX, so the job layer can validate without it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Mapping, Sequence

from specjax.config import ModelConfig
from specjax.errors import SpecjaxError, require

INT32_MAX = 2**31 - 1
SEED_LIMIT = 2**32  # seeds become uint32 device arrays
MIN_TEMPERATURE = 1e-4  # a positive temperature below this overflows float32 logits / t
MAX_TEMPERATURE = 1e4

# The per-request fields a JSONL record may set, beside "id" and "prompt".
REQUEST_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")


@dataclasses.dataclass
class GenerationResult:
    tokens: list[int]
    finish_reason: str  # "eos" | "length"
    prompt_len: int
    prefill_s: float = 0.0
    decode_s: float = 0.0


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _kind(value) -> str:
    return "bool" if isinstance(value, bool) else type(value).__name__


def is_int(value) -> bool:
    """An integer in the schema's sense: int or a NumPy integer, never a bool or a float."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def int_field(name: str, value, lo: int, hi: int) -> int:
    """``value`` as a Python int in [lo, hi]; SpecjaxError naming ``name`` otherwise."""
    if not is_int(value):
        raise SpecjaxError(f"{name} must be an integer, got {_show(value)} ({_kind(value)})")
    v = int(value)
    if not lo <= v <= hi:
        raise SpecjaxError(f"{name} must be an integer in [{lo}, {hi}], got {_show(v)}")
    return v


def number_field(name: str, value, rule: str, ok) -> float:
    """``value`` as a finite Python float for which ``ok(v)`` holds; ``rule`` says the range."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise SpecjaxError(f"{name} must be a number, got {_show(value)} ({_kind(value)})")
    try:
        v = float(value)
    except OverflowError:  # an int too large for a float
        raise SpecjaxError(f"{name} must be {rule}, got {_show(value)}") from None
    if not math.isfinite(v) or not ok(v):
        raise SpecjaxError(f"{name} must be {rule}, got {_show(value)}")
    return v


def check_sampling(temperature, top_k, top_p, seed) -> tuple[float, int, float, int]:
    """The sampling fields, checked and normalised to Python numbers."""
    t = number_field("temperature", temperature,
                     f"0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]",
                     lambda v: v == 0 or MIN_TEMPERATURE <= v <= MAX_TEMPERATURE)
    k = int_field("top_k", top_k, 0, INT32_MAX)
    p = number_field("top_p", top_p, "in (0, 1]", lambda v: 0 < v <= 1)
    s = int_field("seed", seed, 0, SEED_LIMIT - 1)
    return t, k, p, s


def check_max_new_tokens(value) -> int:
    return int_field("max_new_tokens", value, 1, INT32_MAX)


def request_fields(obj: Mapping, defaults: Mapping) -> dict:
    """The request fields of a JSONL record (``obj``), each checked, with ``defaults`` (already
    checked) for the ones it does not set."""
    f = {k: obj.get(k, defaults[k]) for k in REQUEST_FIELDS}
    t, k, p, s = check_sampling(f["temperature"], f["top_k"], f["top_p"], f["seed"])
    return dict(max_new_tokens=check_max_new_tokens(f["max_new_tokens"]), temperature=t, top_k=k, top_p=p, seed=s)


MAX_TAG = 256


def check_tag(tag) -> str | None:
    """A record's optional ``tag`` (the client's label of the request, which a router may send
    to a draft of its own): absent (None) or a non-blank string of at most 256 characters."""
    if tag is None:
        return None
    check_text("tag", tag)
    require(len(tag) <= MAX_TAG, f"tag must be at most {MAX_TAG} characters, got {len(tag)}")
    return tag


def check_text(name: str, text, *, blank_ok: bool = False) -> str:
    """A prompt (or other model input text): a string that is valid Unicode, i.e. encodable as
    UTF-8 (a JSON escape such as \\ud800, or undecodable command-line bytes, give lone
    surrogates, which are not), with some non-blank content unless ``blank_ok``."""
    if not isinstance(text, str):
        raise SpecjaxError(f"{name} must be a string, got {_show(text)} ({_kind(text)})")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise SpecjaxError(f"{name} is not valid UTF-8 text (character {e.start}: {text[e.start]!r})") from None
    if not blank_ok and not text.strip():
        raise SpecjaxError(f"empty {name}: it must contain some text")
    return text


def validate_request(prompt: Sequence[int], max_new_tokens: int, cfg: ModelConfig) -> None:
    """A tokenized request: a non-empty sequence of in-vocabulary integer token ids shorter than
    the context, and a valid max_new_tokens."""
    if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__") or not hasattr(prompt, "__iter__"):
        raise SpecjaxError(f"prompt must be a sequence of token ids, got {_kind(prompt)}")
    require(len(prompt) > 0, "empty prompt: give at least one token of input")
    check_max_new_tokens(max_new_tokens)
    require(len(prompt) < cfg.max_position,
            f"prompt has {len(prompt)} tokens but {cfg.name}'s context is {cfg.max_position}")
    bad = [t for t in prompt if not (is_int(t) and 0 <= int(t) < cfg.vocab_size)]
    require(not bad, f"prompt token ids out of range (integers in [0, {cfg.vocab_size}) expected): "
                     f"{', '.join(_show(t) for t in bad[:5])}")
