"""The suffix trie against its brute-force definition (reference.py): every stored string and
count, pattern counts, incremental match cursors, and whole drafts (tokens, parents, probs,
score, match length: the expansion order) over random token streams with additions,
token-by-token growth and evictions. Small alphabets make repeats, splits of lazy leaves and
the depth cap happen constantly."""

from __future__ import annotations

import numpy as np
import pytest

from specjax.drafters.suffix import SuffixConfig, SuffixDrafter, SuffixTrie
from specjax.drafters.suffix.reference import BruteSuffixIndex
from specjax.errors import SpecjaxError


def _draft_tuple(d):
    return d.tokens.tolist(), d.parents.tolist(), d.probs.tolist(), d.score, d.match_len


def _random_kw(rng):
    return dict(max_spec=int(rng.integers(1, 9)), alpha=float(rng.choice([0.5, 1.0, 2.0, 4.0])),
                offset=float(rng.choice([0.0, 1.0])), min_prob=float(rng.choice([0.0, 0.1, 0.3])),
                tree=bool(rng.random() < 0.7), max_pattern=int(rng.choice([0, 2, 5])) or None)


@pytest.mark.parametrize("seed", range(4))
def test_trie_matches_brute_force_under_inserts_and_evictions(seed):
    rng = np.random.default_rng(seed)
    checks = 0
    for trial in range(60):
        D, V = int(rng.integers(1, 9)), int(rng.integers(2, 6))
        trie, brute = SuffixTrie(D, initial_nodes=16), BruteSuffixIndex(D)
        ids, growing = {}, None
        for _ in range(14):
            r = rng.random()
            if r < 0.35 or not ids:
                toks = rng.integers(0, V, size=int(rng.integers(0, 20))).tolist()
                growing = trie.add(toks)
                ids[growing] = brute.add(toks)
            elif r < 0.75 and growing in ids:
                for _ in range(int(rng.integers(1, 4))):  # token-by-token and chunked growth
                    toks = rng.integers(0, V, size=int(rng.integers(0, 5))).tolist()
                    trie.extend(growing, toks)
                    brute.extend(ids[growing], toks)
            else:
                victim = trie.oldest() if rng.random() < 0.5 else list(ids)[int(rng.integers(len(ids)))]
                trie.remove(victim)
                brute.remove(ids.pop(victim))
            assert trie.dump() == brute.all_strings()
            assert trie.num_tokens == brute.count([])
            for _ in range(4):
                ctx = rng.integers(0, V, size=int(rng.integers(0, 12))).tolist()
                assert trie.count(ctx) == brute.count(ctx)
                kw = _random_kw(rng)
                got, want = _draft_tuple(trie.speculate(ctx, **kw)), brute.speculate(ctx, **kw)
                assert got == tuple(want), (ctx, kw)
                checks += 1
    assert checks > 3000


def test_incremental_cursors_equal_matching_from_scratch():
    rng = np.random.default_rng(7)
    for _ in range(40):
        D, V = int(rng.integers(2, 9)), int(rng.integers(2, 5))
        trie = SuffixTrie(D)
        for _ in range(4):
            trie.add(rng.integers(0, V, size=30).tolist())
        ctx = rng.integers(0, V, size=3).tolist()
        cur = trie.cursors(ctx)
        for _ in range(25):
            t = int(rng.integers(0, V))
            ctx.append(t)
            cur.step([t])
            fresh = trie.cursors(ctx)
            assert (cur.n, cur.u[:cur.n].tolist(), cur.e[:cur.n].tolist()) == \
                   (fresh.n, fresh.u[:fresh.n].tolist(), fresh.e[:fresh.n].tolist())
            for tree in (True, False):
                kw = dict(max_spec=6, alpha=2.0, min_prob=0.0, tree=tree)
                assert _draft_tuple(trie.speculate_cursors(cur, **kw)) == _draft_tuple(trie.speculate(ctx, **kw))


def test_local_active_cursors_give_the_same_draft_as_matching():
    """The per-request tree holds the context itself; its maintained active list must be
    exactly the useful matches."""
    rng = np.random.default_rng(3)
    for _ in range(30):
        D, V = int(rng.integers(2, 9)), int(rng.integers(2, 5))
        trie = SuffixTrie(D)
        sid = trie.add()
        hist = []
        for _ in range(40):
            toks = rng.integers(0, V, size=int(rng.integers(1, 3))).tolist()
            trie.extend(sid, toks)
            hist += toks
            for tree in (True, False):
                kw = dict(max_spec=5, alpha=1.5, min_prob=0.1, tree=tree)
                assert _draft_tuple(trie.speculate_cursors(trie.active_cursors(), **kw)) == \
                       _draft_tuple(trie.speculate(hist, **kw))


def test_stale_cursors_and_bad_tokens_are_refused():
    trie = SuffixTrie(8)
    sid = trie.add([1, 2, 3])
    cur = trie.cursors([1, 2])
    trie.extend(sid, [4])
    with pytest.raises(SpecjaxError, match="stale"):
        trie.speculate_cursors(cur, max_spec=4)
    with pytest.raises(SpecjaxError, match="non-negative"):
        trie.extend(sid, [5, -1])
    assert trie.count([1, 2, 3, 4]) == 1 and trie.count([5]) == 0  # the bad call changed nothing
    with pytest.raises(SpecjaxError, match="newest"):
        trie.add([9])
        trie.extend(sid, [1])
    with pytest.raises(SpecjaxError):
        SuffixConfig(min_prob=2.0)


def test_global_tree_eviction_by_count_and_by_memory():
    d = SuffixDrafter(SuffixConfig(max_depth=16, max_cached_requests=3))
    for i in range(6):
        d.add_output([i, i + 1, i + 2, 7, 7])
    g = d.global_trie
    assert g.num_sequences == 3 and d.evicted == 3
    assert g.count([2, 3, 4]) == 0 and g.count([3, 4, 5]) == 1  # the oldest went first
    rng = np.random.default_rng(0)
    small = SuffixDrafter(SuffixConfig(max_depth=16, max_cached_requests=-1, max_cached_mb=0.05))
    for _ in range(200):
        small.add_output(rng.integers(0, 500, size=100).tolist())
    assert small.global_trie.used_bytes() <= 0.05 * 2 ** 20
    assert small.evicted > 0 and small.global_trie.num_sequences >= 1


def test_drafter_learns_from_finished_requests_and_drafts_from_the_prompt():
    d = SuffixDrafter(SuffixConfig(max_depth=32, alpha=4.0, min_prob=0.0))
    d.start(0, [1, 2, 3, 4, 5, 6, 1, 2])  # the prompt repeats: the local tree predicts 3 4 5 ...
    assert d.propose(0, 4).tolist() == [3, 4, 5, 6]
    d.extend(0, [3, 10, 11, 12, 13])
    d.finish(0)  # its output [3, 10, 11, 12, 13] is now in the global tree
    d.start(1, [99, 3, 10])
    parents, tokens, probs = d.propose_tree(1, 3)
    assert tokens.tolist() == [11, 12, 13] and parents.tolist() == [-1, 0, 1]
    assert len(probs) == 3 and all(0.0 < p <= 1.0 for p in probs)  # per-node acceptance estimates
    assert d.last_draft(1).match_len == 2


def test_wide_expansion_matches_brute_force():
    """Big alphabets, no probability cut and large budgets: hundreds of candidates per expansion
    (the candidate heap grows past its initial size)."""
    rng = np.random.default_rng(1)
    for _ in range(5):
        trie, brute = SuffixTrie(6), BruteSuffixIndex(6)
        for _ in range(30):
            s = rng.integers(0, 40, 60).tolist()
            trie.add(s)
            brute.add(s)
        for _ in range(4):
            ctx = rng.integers(0, 40, 3).tolist()
            kw = dict(max_spec=60, alpha=30.0, min_prob=0.0, tree=True)
            assert _draft_tuple(trie.speculate(ctx, **kw)) == tuple(brute.speculate(ctx, **kw))


def test_a_drafter_told_everything_before_its_kernels_are_in_drafts_as_an_eager_one(monkeypatch):
    """drafter.py's note: until its kernels are in, a drafter records rows' tokens and finished
    outputs (a first answer that never drafts never waits for numba), and builds its tries from
    that record at its first draft: the same drafts, evictions and cursors as a drafter that built
    them as it went, before and after the build."""
    from specjax.drafters.suffix import drafter as sd

    sd.warm_kernels()
    rng = np.random.default_rng(3)
    cfg = SuffixConfig(max_depth=12, max_cached_requests=3, min_prob=0.0)
    history = [rng.integers(0, 6, size=20).tolist() for _ in range(2)]
    eager = SuffixDrafter(cfg, history=history)
    monkeypatch.setattr(sd, "_ready", __import__("threading").Event())  # the kernels not in yet
    lazy = SuffixDrafter(cfg, history=history)
    ops = []
    for row in range(4):
        ops.append(("start", row, rng.integers(0, 6, size=int(rng.integers(3, 30))).tolist()))
        ops += [("extend", row, rng.integers(0, 6, size=int(rng.integers(1, 4))).tolist()) for _ in range(3)]
        if row < 3:
            ops.append(("finish", row, None))  # the third finish evicts
    for name, row, toks in ops:
        for d in (eager, lazy):
            getattr(d, name)(row, *([toks] if toks is not None else []))
    assert lazy._global is None and len(lazy._outputs) == 5  # recorded, not built
    for step in range(6):
        for k in (1, 4, 8):
            assert _draft_tuple(lazy.draft(3, k)) == _draft_tuple(eager.draft(3, k))
        toks = rng.integers(0, 6, size=2).tolist()
        eager.extend(3, toks)
        lazy.extend(3, toks)
    assert lazy.evicted == eager.evicted == 2 and lazy.global_trie.num_sequences == eager.global_trie.num_sequences
