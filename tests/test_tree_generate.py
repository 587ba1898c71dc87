"""Token-tree speculation end to end on the tiny random model: a host drafter that proposes
trees (propose_tree) runs through spec_tree_step (tree forward at seq_len + depth under the
ancestor mask, verify_tree, accepted path compacted into contiguous cache slots) and the
greedy output equals AR greedy token for token, at batch 1 and 3 with mixed prompt lengths,
with no compilation after warm-up."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from specjax.errors import SpecjaxError
from specjax.reference_ar import reference_generate
from specjax.spec_generate import SpecGenerator, SpecStats

PROMPTS = [[30] * 8, [42, 7, 99], [11, 12] * 6]
MAX_NEW = 20
KW = dict(batch_buckets=(1, 4), k_buckets=(0, 2, 4, 8), slot_buckets=(256,))


class OracleTreeDrafter:
    """Knows each row's true greedy continuation; proposes a tree whose first depth-1 sibling
    is wrong, the second starts the right path (correct for `depth_ok` tokens, then wrong),
    plus a duplicate of the wrong sibling and a side branch: acceptance must go through a
    non-first sibling and skip shared tokens."""

    def __init__(self, truth: dict[int, list[int]], vocab: int, depth_ok: int = 3):
        self.truth, self.vocab, self.depth_ok = truth, vocab, depth_ok
        self.hist: dict[int, list[int]] = {}
        self.proposals = 0

    def start(self, row, tokens):
        self.hist[row] = list(tokens)

    def extend(self, row, tokens):
        self.hist[row].extend(int(t) for t in tokens)

    def finish(self, row):
        self.hist.pop(row, None)

    def propose_tree(self, row, k):
        seq, pos = self.truth[row], len(self.hist[row])
        right = seq[pos:pos + self.depth_ok]
        if not right or k < 3:
            return np.zeros(0, np.int32), np.zeros(0, np.int32)
        wrong = (right[0] + 1) % self.vocab
        parents, tokens = [-1, -1, -1], [wrong, right[0], wrong]  # nodes 0, 1, 2 (children of the root)
        last = 1
        for t in right[1:]:
            if len(tokens) >= k:
                break
            parents.append(last)
            tokens.append(t)
            last = len(tokens) - 1
        if len(tokens) < k:
            parents.append(last)
            tokens.append((right[-1] + 3) % self.vocab)  # wrong continuation at the end of the path
        if len(tokens) < k:
            parents.append(0)
            tokens.append(5)  # a side branch under the wrong sibling
        self.proposals += 1
        return np.asarray(parents[:k], np.int32), np.asarray(tokens[:k], np.int32)


class RandomTreeDrafter(OracleTreeDrafter):
    def __init__(self, vocab, seed=0):
        super().__init__({}, vocab)
        self.rng = np.random.default_rng(seed)

    def propose_tree(self, row, k):
        m = int(self.rng.integers(0, k + 1))
        parents = [int(self.rng.integers(-1, i)) for i in range(m)]
        return np.asarray(parents, np.int32), self.rng.integers(0, self.vocab, m).astype(np.int32)


@pytest.fixture(scope="module")
def ar(tiny):
    cfg, params = tiny
    return [r.tokens for r in reference_generate(cfg, params, PROMPTS, max_new_tokens=MAX_NEW, batch_buckets=(1, 4))]


@pytest.mark.parametrize("batch", [1, 3])
def test_tree_speculation_greedy_equals_ar(tiny, ar, batch, caplog):
    cfg, params = tiny
    prompts = PROMPTS[:batch]
    truth = {b: list(prompts[b]) + ar[b] for b in range(batch)}
    drafter = OracleTreeDrafter(truth, cfg.vocab_size)
    gen = SpecGenerator(cfg, params, drafter=drafter, **KW)
    gen.warmup(prompt_lens=(16,), greedy_modes=(True,), batch_buckets=(1, 4))
    stats = SpecStats()
    with caplog.at_level(logging.WARNING, logger="jax"):
        import jax

        with jax.log_compiles(True):
            out = gen.generate(prompts, max_new_tokens=MAX_NEW, num_spec_tokens=8, stats=stats)
    assert [r.tokens for r in out] == ar[:batch]
    assert not [r for r in caplog.records if "Compiling" in r.getMessage()], "compiled after warm-up"
    assert drafter.proposals > 0
    # Through a non-first sibling, 3 right tokens per tree: well above one token per step.
    assert stats.mean_accepted_tokens > 2.5, stats.summary()


def test_random_trees_stay_lossless(tiny, ar):
    cfg, params = tiny
    gen = SpecGenerator(cfg, params, drafter=RandomTreeDrafter(cfg.vocab_size), **KW)
    out = gen.generate(PROMPTS, max_new_tokens=MAX_NEW, num_spec_tokens=8)
    assert [r.tokens for r in out] == ar


def test_bad_tree_from_a_drafter_is_caught(tiny):
    cfg, params = tiny

    class Broken(RandomTreeDrafter):
        def propose_tree(self, row, k):
            return np.asarray([-1, 2], np.int32), np.asarray([1, 2], np.int32)  # a parent after its child

    gen = SpecGenerator(cfg, params, drafter=Broken(cfg.vocab_size), **KW)
    with pytest.raises(ValueError, match="parent must come before"):
        gen.generate(PROMPTS[:1], max_new_tokens=4, num_spec_tokens=4)
