#!/usr/bin/env python
"""llama.cpp on the CPU, through llama-cpp-python: the ``llamacpp`` peer (specjax.peers).

Runs in a venv of its own holding llama-cpp-python (benchmarks/requirements-llamacpp-peer.txt pins the version and the
build command); specjax never imports llama_cpp. It reads the same GGUF specjax loads and is fed the
token ids specjax feeds its own model (never text: llama.cpp does not re-tokenize anything).

Job: ``{"gguf": path, "threads": 2, "max_new_tokens": N, "eos_ids": [...], "modes": ["greedy", "pld",
"prefill", "batch"], "prompts": [{"key", "category", "input_ids"}], "prefill_prompts": [[ids], ...],
"reps": 3, "pld_num_pred_tokens": 10, "pld_max_ngram_size": 2, "batch_sizes": [1, 4, 8],
"batch_prefill": ["mixed", "alone"], "batch_outputs": false, "n_batch": 2048, "n_ubatch": 512,
"flash_attn": false, "omp_wait_policy": "PASSIVE"}`` (all but
``gguf`` optional; llama.cpp's defaults for n_ubatch, flash_attn off as in the binding, and
OMP_WAIT_POLICY as the environment has it unless the job sets it). Modes:

- ``greedy``: AR greedy decoding, batch 1, per prompt: ``prefill_s`` (``Llama.eval`` of the prompt ids
  with ``logits_all=False``, so logits of the last position only, plus the first greedy sample),
  ``decode_s`` (the decode steps alone: ``eval([token])`` + greedy ``sample(temp=0)`` per token
  after the first), ``wall_s`` (their sum), ``new_tokens``, ``output_ids`` (EOS included, as
  specjax reports them), ``stopped_at_eos``. One untimed run of the first prompt first.
- ``pld``: llama-cpp-python's prompt-lookup speculative decoding
  (``Llama(draft_model=LlamaPromptLookupDecoding(max_ngram_size, num_pred_tokens))`` and
  ``Llama.generate(temp=0)``), a second ``Llama`` on the same file: the binding forces
  ``logits_all=True`` when a draft model is set (its prefill then computes logits at every
  prompt position) and has no acceptance counters, so the row has ``wall_s`` (the whole
  ``generate``, prefill included), ``new_tokens``, ``output_ids``, ``evals`` (verify calls after
  the prompt's) and ``evaluated_tokens`` (tokens those calls evaluated); ``pld_equals_greedy``
  (rows have the hf_pld peer's ``greedy`` / ``pld`` layout: specjax.specbench summarizes both alike).
- ``prefill``: per prompt of ``prefill_prompts``, the best of ``reps`` ``eval`` + first sample
  (the AR context, logits of the last position only): ``prefill`` = [{"tokens", "seconds"}].
- ``batch``: the ``Llama`` class holds one sequence, so this goes through the binding's low-level
  API (llama.h): a context with ``n_seq_max`` = B, one ``llama_decode`` per step with one token of
  every live sequence, greedy argmax of each row's logits, a finished sequence's slot refilled
  with the next prompt. ``batch_prefill``: ``mixed`` (the default; llama-server's continuous
  batching: new prompts' chunks ride in the same ``llama_decode`` as the live sequences' tokens,
  up to ``n_batch`` tokens) and/or ``alone`` (each prompt chunk in a call of its own, the steps
  waiting). Per batch size B and prefill mode over all ``prompts``: ``wall_s``, ``new_tokens``,
  ``tok_s`` (new tokens / wall, prefills included), ``steps``, ``equal_to_greedy`` (prompts whose
  output equals the ``greedy`` mode's, informational: batched kernels may round differently),
  ``output_ids`` (per prompt, with ``batch_outputs``; else None).

``env``: llama-cpp-python's version, ``llama_print_system_info()`` (the CPU features llama.cpp
was built for and uses), threads, the context settings.
"""
from __future__ import annotations

import os
import sys
import time

from specjax.peers import peer_main


def _greedy(llm) -> int:
    # (llama-cpp-python builds a penalties + greedy sampler chain per call; repeat penalty 1 = off)
    return int(llm.sample(temp=0.0, repeat_penalty=1.0))


def run_ar(llm, ids, n_new: int, eos: set) -> dict:
    llm.reset()  # (a reset context: no prefix of the previous prompt is reused)
    t0 = time.perf_counter()
    llm.eval(ids)
    tok = _greedy(llm)
    t1 = time.perf_counter()
    out = [tok]
    while tok not in eos and len(out) < n_new:
        llm.eval([tok])
        tok = _greedy(llm)
        out.append(tok)
    t2 = time.perf_counter()
    return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "wall_s": t2 - t0, "new_tokens": len(out),
            "output_ids": out, "stopped_at_eos": out[-1] in eos}


def run_pld(llm, ids, n_new: int, eos: set) -> dict:
    calls = []
    evaluate = type(llm).eval

    def counted(tokens):  # the binding's own eval, counted (prompt first, then one per verify)
        calls.append(len(tokens))
        return evaluate(llm, tokens)

    llm.eval = counted
    llm.reset()
    out = []
    t0 = time.perf_counter()
    for tok in llm.generate(ids, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(tok))
        if out[-1] in eos or len(out) >= n_new:
            break
    wall = time.perf_counter() - t0
    del llm.eval
    return {"wall_s": wall, "new_tokens": len(out), "output_ids": out, "evals": len(calls) - 1,
            "evaluated_tokens": sum(calls[1:])}


def run_batch(llm, prompts, n_new: int, eos: set, size: int, threads: int, n_batch: int, n_ubatch: int,
              flash_attn: bool, prefill: str = "mixed") -> dict:
    import llama_cpp as L
    import numpy as np

    per_seq = max(len(p) for p in prompts) + n_new + 8
    per_seq = -(-per_seq // 256) * 256
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_seq_max = per_seq * size, size
    cp.n_batch, cp.n_ubatch = max(n_batch, size), n_ubatch
    cp.n_threads = cp.n_threads_batch = threads
    cp.no_perf = True
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = L.llama_init_from_model(llm.model, cp)
    if not ctx:
        raise RuntimeError(f"llama_init_from_model failed for {size} sequences")
    mem = L.llama_get_memory(ctx)
    vocab = llm.n_vocab()
    cap = cp.n_batch
    batch = L.llama_batch_init(cap, 0, 1)

    def decode(entries):  # [(token, pos, seq, wants_logits)]
        for i, (t, p, s, want) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, p, 1, want
            batch.seq_id[i][0] = s
        batch.n_tokens = len(entries)
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def argmax(i):
        return int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(vocab,)).argmax())

    queue = list(range(len(prompts)))
    outs: list[list[int]] = [[] for _ in prompts]
    live = {}  # seq -> (prompt index, next position): decoding
    filling = {}  # seq -> (prompt index, prompt tokens in so far): prefilling
    steps = 0
    t0 = time.perf_counter()
    try:
        while queue or live or filling:
            for s in range(size):  # a free sequence takes the next prompt
                if s not in live and s not in filling and queue:
                    L.llama_memory_seq_rm(mem, s, -1, -1)
                    filling[s] = (queue.pop(0), 0)
            # One llama_decode: every live sequence's next token, then ("mixed", as llama-server's
            # continuous batching) prompt chunks up to n_batch tokens, or ("alone") one prompt
            # chunk by itself while any prompt is still going in.
            order = sorted(live) if (prefill == "mixed" or not filling) else []
            entries = [(outs[live[s][0]][-1], live[s][1], s, True) for s in order]
            done = []  # (seq, prompt index, batch index of the prompt's last token)
            for s in sorted(filling):
                room = cap - len(entries)
                if room <= 0 or (prefill != "mixed" and entries):
                    break
                j, a = filling[s]
                ids = prompts[j]
                chunk = ids[a:a + room]
                entries += [(t, a + k, s, a + k == len(ids) - 1) for k, t in enumerate(chunk)]
                if a + len(chunk) == len(ids):
                    done.append((s, j, len(entries) - 1))
                    del filling[s]
                else:
                    filling[s] = (j, a + len(chunk))
            decode(entries)
            steps += bool(order)
            for i, s in enumerate(order):
                j, pos = live[s]
                outs[j].append(argmax(i))
                if outs[j][-1] in eos or len(outs[j]) >= n_new:
                    del live[s]
                else:
                    live[s] = (j, pos + 1)
            for s, j, i in done:  # a prompt is in: its first token, then it decodes
                outs[j].append(argmax(i))
                if outs[j][-1] not in eos and n_new > 1:
                    live[s] = (j, len(prompts[j]))
        wall = time.perf_counter() - t0
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
    n = sum(len(o) for o in outs)
    return {"batch_size": size, "prefill": prefill, "wall_s": wall, "new_tokens": n, "tok_s": n / wall,
            "steps": steps, "outputs": outs}


def _say(msg: str) -> None:
    print(f"[llama.cpp peer: {msg}]", file=sys.stderr, flush=True)


def run(job: dict) -> dict:
    if job.get("omp_wait_policy"):
        # (read by libgomp when llama_cpp loads ggml: PASSIVE keeps llama.cpp's OpenMP threads from
        # spinning at barriers, which on a shared machine costs it 5-50x when a core is taken)
        os.environ["OMP_WAIT_POLICY"] = job["omp_wait_policy"]
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    modes = job.get("modes") or ["greedy", "pld"]
    threads = int(job.get("threads", 2))
    n_new = int(job.get("max_new_tokens", 96))
    eos = {int(e) for e in job.get("eos_ids") or []}
    prompts = job.get("prompts") or []
    pre = job.get("prefill_prompts") or []
    reps = int(job.get("reps", 3))
    n_batch, n_ubatch = int(job.get("n_batch", 2048)), int(job.get("n_ubatch", 512))
    flash = bool(job.get("flash_attn", False))
    longest = max([len(p["input_ids"]) for p in prompts] + [len(p) for p in pre] + [1])
    n_ctx = -(-(longest + n_new + int(job.get("pld_num_pred_tokens", 10)) + 8) // 256) * 256
    kw = dict(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=threads, n_threads_batch=threads,
              flash_attn=flash, verbose=False)
    t0 = time.perf_counter()
    llm = Llama(job["gguf"], logits_all=False, **kw)
    load_s = time.perf_counter() - t0
    if not eos:
        eos = {llm.token_eos()}
    res = {"rows": [], "env": {
        "llama_cpp_python": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
        "threads": threads, "n_ctx": n_ctx, "n_batch": n_batch, "n_ubatch": n_ubatch, "flash_attn": flash,
        "gguf": os.path.abspath(job["gguf"]), "max_new_tokens": n_new, "eos_ids": sorted(eos), "load_s": load_s,
        "modes": modes, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset: libgomp's default)"),
        "sampling": "greedy: Llama.sample(temp=0, repeat_penalty=1)"}}

    rows = {p["key"]: {"key": p["key"], "category": p.get("category"), "prompt_tokens": len(p["input_ids"])}
            for p in prompts}
    if "greedy" in modes and prompts:
        _say(f"greedy on {len(prompts)} prompts")
        run_ar(llm, prompts[0]["input_ids"], min(16, n_new), eos)  # untimed warm-up
        for p in prompts:
            rows[p["key"]]["greedy"] = run_ar(llm, p["input_ids"], n_new, eos)
    if "prefill" in modes and pre:
        _say(f"prefill at {[len(p) for p in pre]} tokens")
        run_ar(llm, pre[0], 1, eos)
        res["prefill"] = [{"tokens": len(ids), "seconds": min(run_ar(llm, ids, 1, eos)["prefill_s"]
                                                              for _ in range(max(reps, 1)))} for ids in pre]
    if "batch" in modes and prompts:
        ids = [p["input_ids"] for p in prompts]
        res["batch"] = []
        for b in job.get("batch_sizes") or [1, 4, 8]:
            for how in job.get("batch_prefill") or ["mixed"]:
                _say(f"{len(ids)} prompts as {b} parallel sequences, prefill {how}")
                r = run_batch(llm, ids, n_new, eos, int(b), threads, n_batch, n_ubatch, flash, how)
                outs = r.pop("outputs")
                r["equal_to_greedy"] = (sum(o == rows[p["key"]]["greedy"]["output_ids"] for o, p in zip(outs, prompts))
                                        if "greedy" in modes else None)
                r["output_ids"] = outs if job.get("batch_outputs") else None
                res["batch"].append(r)
        res["env"]["batch"] = ("low-level llama.h API (llama_batch with one seq_id per row, n_seq_max = B); "
                               "the Llama class decodes one sequence")
    if "pld" in modes and prompts:
        nk = {"max_ngram_size": int(job.get("pld_max_ngram_size", 2)),
              "num_pred_tokens": int(job.get("pld_num_pred_tokens", 10))}
        llm.close()  # (one model in memory at a time)
        spec = Llama(job["gguf"], draft_model=LlamaPromptLookupDecoding(**nk), **kw)
        _say(f"prompt lookup on {len(prompts)} prompts")
        run_pld(spec, prompts[0]["input_ids"], min(16, n_new), eos)
        for p in prompts:
            r = rows[p["key"]]
            r["pld"] = run_pld(spec, p["input_ids"], n_new, eos)
            if "greedy" in r:
                r["pld_equals_greedy"] = r["pld"]["output_ids"] == r["greedy"]["output_ids"]
        res["env"]["pld"] = {**nk, "logits_all": True}
        spec.close()
    res["rows"] = list(rows.values())
    return res


if __name__ == "__main__":
    sys.exit(peer_main(run))
