"""A tiny llama.cpp-style GGUF writer (byte-level BPE vocabulary, ChatML template) for the
weight-loading and rows-kernel tests."""

from __future__ import annotations

import numpy as np

from specjax.config import get_model_config
from specjax.models import weights

TINY = get_model_config("tiny-random")


def tiny_bpe_vocab():
    """256-char byte-level alphabet (sorted) + merge results + 2 ChatML specials."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    assert len(alphabet) == 256
    merges = ["h e", "l l", "Ġ t", "Ġt he", "he ll", "hell o"]
    merged = [m.replace(" ", "") for m in merges]
    specials = ["<|im_start|>", "<|im_end|>"]
    tokens = alphabet + merged + specials
    types = [1] * (len(alphabet) + len(merged)) + [3] * len(specials)
    return tokens, merges, types


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def write_tiny_gguf(path, cfg, params, tokens, merges, types, *, write_vocab_size=True, pre="default",
                    proj_type=None, embed_type=None):
    """A llama.cpp-style GGUF: F32 tensors (``proj_type`` / ``embed_type``: a GGMLQuantizationType
    for the projection matrices / the token embedding instead), llama.cpp names, torch ([out, in])
    layout, q/k rows permuted for the llama arch (as convert_hf_to_gguf.py does)."""
    import gguf

    arch = cfg.arch
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    w.add_uint32(f"{arch}.block_count", cfg.num_layers)
    w.add_uint32(f"{arch}.context_length", cfg.max_position)
    w.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    w.add_uint32(f"{arch}.attention.head_count", cfg.num_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_kv_heads)
    w.add_uint32(f"{arch}.rope.dimension_count", cfg.head_dim)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_theta)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_eps)
    if write_vocab_size:
        w.add_uint32(f"{arch}.vocab_size", cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)

    permute = cfg.arch == "llama"

    def t(name, a, qtype=None):
        a = np.ascontiguousarray(np.asarray(a, np.float32))
        if qtype is None:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)

    t("token_embd.weight", params["embed"], embed_type)  # [V, D]
    t("output_norm.weight", params["final_norm"])
    if not cfg.tie_embeddings:
        t("output.weight", np.asarray(params["lm_head"]).T)
    for i, lp in enumerate(params["layers"]):
        def torch(k):
            return np.asarray(lp[k]).T  # [out, in]
        wq, wk = torch("wq"), torch("wk")
        if permute:
            wq, wk = weights.permute_qk(wq, cfg.num_heads), weights.permute_qk(wk, cfg.num_kv_heads)
        t(f"blk.{i}.attn_norm.weight", lp["attn_norm"])
        t(f"blk.{i}.attn_q.weight", wq, proj_type)
        t(f"blk.{i}.attn_k.weight", wk, proj_type)
        t(f"blk.{i}.attn_v.weight", torch("wv"), proj_type)
        t(f"blk.{i}.attn_output.weight", torch("wo"), proj_type)
        if cfg.qkv_bias:
            t(f"blk.{i}.attn_q.bias", lp["bq"])
            t(f"blk.{i}.attn_k.bias", lp["bk"])
            t(f"blk.{i}.attn_v.bias", lp["bv"])
        t(f"blk.{i}.ffn_norm.weight", lp["mlp_norm"])
        t(f"blk.{i}.ffn_gate.weight", torch("w_gate"), proj_type)
        t(f"blk.{i}.ffn_up.weight", torch("w_up"), proj_type)
        t(f"blk.{i}.ffn_down.weight", torch("w_down"), proj_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _gguf_cfg(variant, vocab):
    base = TINY.replace(vocab_size=vocab, rope_theta=50000.0, rms_eps=1e-6, max_position=512)
    return {
        "llama": base,
        "llama_tied": base.replace(tie_embeddings=True),
        "qwen2": base.replace(arch="qwen2", qkv_bias=True),
    }[variant]
