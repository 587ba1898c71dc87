#!/usr/bin/env python
"""Conversations, turn after turn: what storing finished outputs in the prefix cache saves.

Each conversation is a chat client's: the user asks GSM8K training questions one per turn
(``--data_dir``, ../shared/data by default), the model answers (greedy), and every next turn
resends the conversation as token ids (its previous prompt, the model's answer, the next user
message in the chat template), as llama.cpp's server and vLLM's clients keep it. The same
conversations run through three plain-decoding generators, conversation by conversation, each
generator first in turn:

- *off*: no prefix cache (every turn prefills the whole conversation);
- *prompts*: the prefix cache as served by default (a turn reuses the chunks of earlier
  prompts' prefills, so the previous answer and what follows it are prefilled again);
- *outputs*: the cache with ``prefix_cache_outputs`` (a finished turn's prompt + answer chunks
  stored from its row: the next turn prefills little more than its new message).

Printed: prompt tokens prefilled, mean time to the first token of a turn (``prefill_s``: the
admission, restores included), end-to-end seconds, and how many turns' answers equal the
*off* generator's.

  python benchmarks/chat_turns.py [--conversations 4 --turns 6 --max_new 128 --prefill_chunk 128]
"""

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max_new", type=int, default=128)
    ap.add_argument("--prefill_chunk", type=int, default=128)
    ap.add_argument("--data_dir", default=os.path.join(ROOT, "..", "shared", "data"))
    a = ap.parse_args()

    from specjax.generate import Generator
    from specjax.models.loader import load_model
    from specjax.models.options import ForwardOptions

    with open(os.path.join(a.data_dir, "gsm8k", "train.jsonl"), encoding="utf-8") as f:
        questions = [json.loads(line)["question"] for _, line in zip(range(a.conversations * a.turns), f)]
    m = load_model("smollm2-135m")
    tok = m.tokenizer
    fwd = ForwardOptions(rows_kernel=m.auto_rows_kernel())
    params = m.params_for(fwd)
    kinds = {"off": dict(prefix_cache_mb=0), "prompts": {}, "outputs": dict(prefix_cache_outputs=True)}
    gens = {k: Generator(m.cfg, params, eos_ids=tok.eos_ids, fwd=fwd, batch_buckets=(1,),
                         prefill_chunk=a.prefill_chunk, **kw) for k, kw in kinds.items()}
    # a user turn in the chat template, after the previous answer's end-of-turn token
    marker = "\x00"
    text = tok.apply_chat_template([{"role": "user", "content": marker}])
    user_turn = text[text.index("<|im_start|>user"):]
    end_of_turn = tok.eos_ids[0]

    def conversation(g, qs):
        prompt, answers, prefill, tokens, t0 = tok.encode_chat(qs[0]), [], 0.0, 0, time.perf_counter()
        for i, q in enumerate(qs):
            if i:
                prompt = prompt + answers[-1] + ([] if answers[-1][-1:] == [end_of_turn] else [end_of_turn]) \
                    + tok.encode("\n" + user_turn.replace(marker, q), add_bos=False)
            r = g.generate([prompt], max_new_tokens=a.max_new)[0]
            answers.append(list(r.tokens))
            prefill += r.prefill_s
            tokens += len(prompt)
        return answers, prefill, time.perf_counter() - t0, tokens, len(prompt)

    # compile and run once, untimed: a two-turn conversation opening at each slot bucket the
    # measured ones reach (each generator compiles its own programs per bucket on first use)
    filler = " ".join(questions)
    for g in gens.values():
        for n in (50, 300, 700, 1500):
            opening = tok.decode(tok.encode(filler, add_bos=False)[:n])
            conversation(g, [opening + "\nWhat is 2 + 3?", "And 4 + 5?"])
    base = {k: (g.prefix_stats.tokens_prefilled if g.prefix_stats else 0) for k, g in gens.items()}
    res = {k: {"wall": 0.0, "prefill": 0.0, "tokens": 0, "same": 0} for k in gens}
    ref = {}
    for c in range(a.conversations):
        qs = questions[c * a.turns:(c + 1) * a.turns]
        for k in list(gens)[c % len(gens):] + list(gens)[:c % len(gens)]:  # (each goes first in turn)
            g = gens[k]
            answers, prefill, wall, tokens, last_len = conversation(g, qs)
            res[k]["wall"] += wall
            res[k]["prefill"] += prefill
            res[k]["tokens"] += tokens
            ref[c, k] = answers
        for k in gens:
            res[k]["same"] += sum(x == y for x, y in zip(ref[c, k], ref[c, "off"]))
        print(f"conversation {c + 1}/{a.conversations}: last prompt {last_len} tokens", flush=True)
    n = a.conversations * a.turns
    print(f"\nSmolLM2-135M-Instruct ({'rows kernel' if fwd.rows_kernel else 'XLA dot'}), {a.conversations} "
          f"conversations x {a.turns} turns, {a.max_new} new tokens at most, greedy, prefill chunk {a.prefill_chunk}, "
          f"batch 1\n")
    print("| prefix cache | prompt tokens prefilled | mean first token, ms | end to end, s | vs off | answers equal off's |")
    print("|---|---|---|---|---|---|")
    for k, g in gens.items():
        st = g.prefix_stats
        filled = st.tokens_prefilled - base[k] if st else res[k]["tokens"]
        print(f"| {k} | {filled} of {res[k]['tokens']} | {1e3 * res[k]['prefill'] / n:.0f} | {res[k]['wall']:.1f} | "
              f"{res['off']['wall'] / res[k]['wall']:.2f}x | {res[k]['same']}/{n} |")
    st = gens["outputs"].prefix_stats
    print(f"\n(outputs, the whole run with its warm-up: {st.line()})")


if __name__ == "__main__":
    main()
