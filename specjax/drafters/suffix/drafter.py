"""SuffixDecoding drafter: a global suffix tree over past outputs plus a per-request tree.

Per request (batch row), a local trie holds the prompt and the live output; one
global trie holds the outputs of finished requests (optionally preloaded from a
log of past outputs) and is updated as each request finishes, evicting the
oldest outputs beyond a count or a memory bound. Every step both tries propose
their best draft over all match lengths (Algorithm 1 of the paper, see
`kernels.speculate`) and the higher score wins.

Matching is incremental: the local trie's own bookkeeping already knows which
suffixes of the sequence repeat (`active_cursors`), and the global trie's match
cursors advance one token at a time, rebuilt only after the global trie changes.

The tries run numba kernels, whose import and cached code take about a second to load. Until a
drafter first drafts, or until they are in (``warm_kernels``, which a launch script starts in a
thread beside the model load), a drafter only records what it is told (rows' tokens, finished
outputs) and builds its tries from that record then: the same tries, so the same drafts. A
first answer that never drafts never waits for numba.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

from specjax.errors import require

if TYPE_CHECKING:
    from specjax.drafters.suffix.trie import Cursors, Draft, SuffixTrie


@dataclasses.dataclass(frozen=True)
class SuffixConfig:
    max_depth: int = 64  # suffix-tree depth cap (longest pattern + continuation stored)
    alpha: float = 1.0  # MAX_SPEC = alpha * match length (+ offset), capped by max_spec and K
    offset: float = 0.0
    min_prob: float = 0.1  # drop draft nodes whose estimated acceptance D(N) is below this
    tree: bool = True  # token trees (best-first) vs a single path
    max_spec: int = 64  # upper bound on draft tokens per step (the K bucket bounds it too)
    max_pattern: int = 0  # longest match length tried; 0 = max_depth - 1
    max_cached_requests: int = 100_000  # outputs kept in the global tree; -1 unlimited, 0 = no global tree
    max_cached_mb: float = 1024.0  # memory bound of the global tree (its live content)
    use_local: bool = True  # also speculate from the request's own prompt and output

    def __post_init__(self):
        require(1 <= self.max_depth <= 1024, f"suffix max_depth must be in [1, 1024], got {self.max_depth}")
        require(self.alpha > 0, f"suffix alpha (max spec factor) must be > 0, got {self.alpha}")
        require(0.0 <= self.min_prob <= 1.0, f"suffix min_prob must be in [0, 1], got {self.min_prob}")
        require(self.max_spec >= 1, f"suffix max_spec must be >= 1, got {self.max_spec}")
        require(self.max_pattern >= 0, f"suffix max_pattern must be >= 0, got {self.max_pattern}")
        require(self.max_cached_requests >= -1, "suffix max_cached_requests must be -1 (unlimited) or >= 0")
        require(self.max_cached_mb > 0, f"suffix max_cached_mb must be > 0, got {self.max_cached_mb}")


class _Row:
    __slots__ = ("local", "sid", "history", "prompt_len", "gcur", "last")

    def __init__(self):
        self.local = None  # its SuffixTrie, once the drafter's tries are built
        self.sid = -1
        self.history: list[int] = []
        self.prompt_len = 0
        self.gcur: Cursors | None = None
        self.last: Draft | None = None


_warm = False
_warm_lock = threading.RLock()  # (re-entered: the throwaway drafter's first draft calls warm_kernels)
_ready = threading.Event()  # the kernels are in


def warm_kernels() -> None:
    """Call every numba kernel the drafter uses once, on a throwaway drafter (once per process;
    another thread's call meanwhile waits for it, so a launch script may start it in a thread
    beside the model load, cli.prewarm_drafter): a kernel's first call compiles it (about 19 s
    here with numba's disk cache cold, 0.3 s warm), and that must not land on the first requests
    a serving engine drafts for."""
    global _warm
    with _warm_lock:
        if _warm:
            return
        _warm = True
        _warm_up()
        _ready.set()


def _warm_up() -> None:
    d = SuffixDrafter(SuffixConfig(max_cached_requests=1))
    for row in range(3):  # the third finish evicts (removes) a cached output
        d.start(row, [5, 6, 7, 5, 6])
        d.extend(row, [7])
        d.propose_tree(row, 4)
        d.extend(row, [5, 6])  # (the global tree's match cursors step)
        d.propose(row, 4)
        d.finish(row)


class SuffixDrafter:
    """Host drafter (start / extend / propose / propose_tree / finish per batch row)."""

    def __init__(self, config: SuffixConfig = SuffixConfig(), history: Iterable[Sequence[int]] = ()):
        self.config = config
        self._global: SuffixTrie | None = None  # built by _build
        self._outputs: list[list[int]] = []  # finished outputs recorded before it was
        self._rows: dict[int, _Row] = {}
        self.evicted = 0
        for out in history:
            self.add_output(out)

    @property
    def global_trie(self) -> "SuffixTrie":
        self._build(wait=True)
        return self._global

    def _build(self, wait: bool) -> bool:
        """Build the tries from what was recorded (the kernels loaded first: waited for if
        ``wait``, else only if they are in already); whether they are built."""
        if self._global is not None:
            return True
        if not (wait or _ready.is_set()):
            return False
        from specjax.drafters.suffix.trie import SuffixTrie

        warm_kernels()
        self._global = SuffixTrie(self.config.max_depth, initial_nodes=4096)
        outputs, self._outputs = self._outputs, []
        for out in outputs:
            self.add_output(out)
        for r in self._rows.values():
            r.local = SuffixTrie(self.config.max_depth)
            r.sid = r.local.add(r.history)
        return True

    @property
    def proposes_trees(self) -> bool:
        return self.config.tree

    # ------------------------------------------------------------------ lifecycle

    def start(self, row: int, tokens: Sequence[int]) -> None:
        r = _Row()
        self._rows[row] = r
        toks = [int(t) for t in tokens]
        r.prompt_len = len(toks)
        if self._global is not None:
            from specjax.drafters.suffix.trie import SuffixTrie

            r.local = SuffixTrie(self.config.max_depth)
            r.sid = r.local.add()
        self._append(r, toks)

    def extend(self, row: int, tokens: Sequence[int]) -> None:
        self._append(self._get(row), [int(t) for t in tokens])

    def finish(self, row: int) -> None:
        """The request is over: its output joins the global tree (then eviction)."""
        r = self._rows.pop(row, None)
        if r is not None:
            self.add_output(r.history[r.prompt_len:])

    def add_output(self, tokens: Sequence[int]) -> None:
        """Cache one finished output in the global tree (also used to preload from logs)."""
        cfg = self.config
        if cfg.max_cached_requests == 0 or len(tokens) == 0:
            return
        if not self._build(wait=False):
            self._outputs.append([int(t) for t in tokens])
            return
        g = self._global
        g.add(tokens)
        limit = cfg.max_cached_mb * 2 ** 20
        while g.num_sequences > 1 and (
                (cfg.max_cached_requests > 0 and g.num_sequences > cfg.max_cached_requests)
                or g.used_bytes() > limit):
            g.remove(g.oldest())
            self.evicted += 1

    def clear_cache(self) -> None:
        """Empty the global tree (e.g. after a warm-up run whose output must not be reused)."""
        self._outputs.clear()
        if self._global is not None:
            from specjax.drafters.suffix.trie import SuffixTrie

            self._global = SuffixTrie(self.config.max_depth, initial_nodes=4096)
            for r in self._rows.values():
                r.gcur = None

    # ------------------------------------------------------------------ drafting


    def forget_outputs(self) -> None:
        """The drafters.protocol hook: ``clear_cache``."""
        self.clear_cache()
    def draft(self, row: int, max_spec: int, tree: bool | None = None) -> Draft:
        """The best draft of both trees for this row (highest score, then longer match)."""
        from specjax.drafters.suffix.trie import Draft

        self._build(wait=True)
        cfg = self.config
        r = self._get(row)
        tree = cfg.tree if tree is None else tree
        m = min(max_spec, cfg.max_spec)
        best = Draft.empty()
        if m <= 0:
            r.last = best
            return best
        kw = dict(max_spec=m, alpha=cfg.alpha, offset=cfg.offset, min_prob=cfg.min_prob, tree=tree,
                  max_pattern=cfg.max_pattern or None)
        g = self._global
        if g.num_tokens:
            if r.gcur is None or r.gcur.version != g.version:
                r.gcur = g.cursors(r.history[-cfg.max_depth:])
            best = g.speculate_cursors(r.gcur, **kw)
        if cfg.use_local:
            d = r.local.speculate_cursors(r.local.active_cursors(), **kw)
            if (d.score, d.match_len) > (best.score, best.match_len):
                best = d
        r.last = best
        return best

    def propose(self, row: int, k: int) -> np.ndarray:
        """Path-mode draft tokens (a chain)."""
        return self.draft(row, k, tree=False).tokens

    def propose_tree(self, row: int, max_nodes: int):
        """(parents, tokens, probs) of the draft tree; parent -1 is the last token of the history
        and probs[i] the estimated probability that node i is accepted (the goodput predictor)."""
        d = self.draft(row, max_nodes)
        return d.parents, d.tokens, d.probs

    def last_draft(self, row: int) -> Draft:
        from specjax.drafters.suffix.trie import Draft

        last = self._get(row).last
        return Draft.empty() if last is None else last

    # ------------------------------------------------------------------ internals

    def _append(self, r: _Row, toks: list[int]) -> None:
        if not toks:
            return
        r.history.extend(toks)
        if r.local is None:  # (built later from the history, or now: from it)
            self._build(wait=False)
            return
        r.local.extend(r.sid, toks)
        g = self._global
        if r.gcur is not None and r.gcur.version == g.version:
            r.gcur.step(toks)
        else:
            r.gcur = None  # rebuilt lazily at the next draft

    def _get(self, row: int) -> _Row:
        r = self._rows.get(row)
        require(r is not None, f"suffix drafter row {row} has no active request (call start first)")
        return r
