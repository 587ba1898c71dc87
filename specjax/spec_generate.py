"""Speculative generation: host loop over precompiled spec steps.

``SpecGenerator`` owns a ``StepTable`` of compiled executables keyed by
(batch bucket, K, cache slots, greedy_only) plus compiled prefills keyed by
(batch bucket, prompt bucket, slots, greedy_only). ``warmup`` compiles every variant
the configured buckets allow; afterwards generation only calls compiled executables
(and raises instead of compiling if asked for a shape that was not warmed up).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import buckets as bk
from specjax import tree
from specjax.config import ModelConfig
from specjax.drafters.base import NoDrafter
from specjax.engine.step import DraftSpec, StepState
from specjax.engine.table import StepTable
from specjax.errors import SpecjaxError, require
from specjax.generate import GenerationResult, validate_request
from specjax.sampling import SamplingArrays, SamplingParams


@dataclasses.dataclass
class SpecStats:
    """vLLM-style speculative metrics over row-steps of active rows."""

    steps: int = 0  # row-steps
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    pos_drafted: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    pos_accepted: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))

    def record(self, num_draft: int, n_acc: int, emitted: int):
        self.steps += 1
        self.drafted += num_draft
        self.accepted += n_acc
        self.emitted += emitted
        if num_draft > len(self.pos_drafted):
            grow = num_draft - len(self.pos_drafted)
            self.pos_drafted = np.concatenate([self.pos_drafted, np.zeros(grow, np.int64)])
            self.pos_accepted = np.concatenate([self.pos_accepted, np.zeros(grow, np.int64)])
        self.pos_drafted[:num_draft] += 1
        self.pos_accepted[:n_acc] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens committed per verify step, bonus included (vLLM's mean acceptance length)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [float(a / d) if d else 0.0 for a, d in zip(self.pos_accepted, self.pos_drafted)]

    def summary(self) -> dict:
        return {"steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": self.acceptance_rate, "mean_accepted_tokens": self.mean_accepted_tokens,
                "per_position_acceptance": self.per_position_acceptance}


class SpecGenerator:
    def __init__(self, cfg: ModelConfig, params, *, eos_ids: Sequence[int] = (), drafter=None,
                 draft: DraftSpec = DraftSpec(), draft_params=None, k_buckets: Sequence[int] = (0, 1, 2, 4, 8),
                 batch_buckets: Sequence[int] = (1, 2, 4, 8), slot_buckets: Sequence[int] = (256, 512, 1024, 2048),
                 attention_impl: str = "xla", shrink_to_proposal: bool = True):
        require(0 in k_buckets, "k_buckets must include 0 (plain decoding)")
        if draft.kind == "model":
            require(draft.cfg is not None, "a model drafter needs its config")
            require(draft_params is not None or draft.num_layers is not None,
                    "an independent draft model needs its params (a layer-skip self-draft uses the target's)")
            if draft.cfg.vocab_size != cfg.vocab_size:
                raise SpecjaxError(f"draft model vocabulary ({draft.cfg.vocab_size}) differs from the target's "
                                   f"({cfg.vocab_size}); draft and target must share a tokenizer")
        self.cfg = cfg
        self.params = params
        self.dparams = draft_params if draft_params is not None else params
        self.draft = draft
        self.drafter = drafter if drafter is not None else NoDrafter()
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self.k_buckets = tuple(sorted(set(k_buckets)))
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.slot_buckets = tuple(sorted(s for s in slot_buckets if s <= cfg.max_position)) or (cfg.max_position,)
        self.attention_impl = attention_impl
        self.shrink_to_proposal = shrink_to_proposal
        # A host drafter with propose_tree() proposes token trees (verified by spec_tree_step);
        # a chain is the path tree, and N = K + 1 nodes reuses the K buckets.
        self.tree_mode = draft.kind != "model" and bool(
            getattr(self.drafter, "proposes_trees", hasattr(self.drafter, "propose_tree")))
        self.table = StepTable(cfg, params, self.dparams, draft, attention_impl)

    # ------------------------------------------------------------ compilation

    @property
    def warm(self) -> bool:
        return self.table.warm

    @warm.setter
    def warm(self, value: bool) -> None:
        self.table.warm = value

    def _prefill_exec(self, B, Tp, S, greedy_only, compile_if_missing=False):
        return self.table.prefill(B, Tp, S, greedy_only, compile_if_missing=compile_if_missing)

    def _step_exec(self, B, K, S, greedy_only):
        return self.table.step(B, K, S, greedy_only)

    def _tree_step_exec(self, B, K, S, greedy_only):
        return self.table.tree_step(B, K, S, greedy_only)

    def warmup(self, prompt_buckets: Sequence[int] = (16, 32, 64, 128, 256), greedy_modes=(True, False),
               batch_buckets: Sequence[int] | None = None, slot_buckets: Sequence[int] | None = None,
               k_buckets: Sequence[int] | None = None) -> float:
        """Compile every (batch, K, slots, mode) step and (batch, prompt, slots, mode) prefill. Returns seconds."""
        t0 = time.perf_counter()
        for B in batch_buckets or self.batch_buckets:
            for S in slot_buckets or self.slot_buckets:
                for g in greedy_modes:
                    for Tp in prompt_buckets:
                        if Tp <= S:
                            self._prefill_exec(B, Tp, S, g, compile_if_missing=True)
                    for K in k_buckets or self.k_buckets:
                        (self._tree_step_exec if self.tree_mode else self._step_exec)(B, K, S, g)
        self.warm = True
        return time.perf_counter() - t0

    # ------------------------------------------------------------ generation

    def generate(self, prompts: Sequence[Sequence[int]], sampling=SamplingParams(), max_new_tokens: int = 128,
                 num_spec_tokens: int = 4, ignore_eos: bool = False, stats: SpecStats | None = None
                 ) -> list[GenerationResult]:
        if isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompts)
        require(len(sampling) == len(prompts), "one SamplingParams per prompt")
        require(num_spec_tokens in self.k_buckets,
                f"num_spec_tokens={num_spec_tokens} is not a precompiled K bucket {list(self.k_buckets)}"
                if num_spec_tokens <= max(self.k_buckets) else
                f"num_spec_tokens={num_spec_tokens} exceeds the largest K bucket {max(self.k_buckets)}")
        for p in prompts:
            validate_request(p, max_new_tokens, self.cfg)
        stats = stats if stats is not None else SpecStats()
        out = []
        max_b = self.batch_buckets[-1]
        for i in range(0, len(prompts), max_b):
            out.extend(self._generate_batch(prompts[i:i + max_b], sampling[i:i + max_b], max_new_tokens,
                                            num_spec_tokens, ignore_eos, stats))
        return out

    def _generate_batch(self, prompts, sampling, max_new_tokens, K, ignore_eos, stats: SpecStats):
        cfg = self.cfg
        n = len(prompts)
        B = bk.pick(self.batch_buckets, n, "batch size")
        lens = np.array([len(p) for p in prompts] + [1] * (B - n), np.int32)
        Kmax = max(self.k_buckets)
        need = int(lens.max()) + max_new_tokens + Kmax + 1
        S = next((s for s in self.slot_buckets if s >= need), self.slot_buckets[-1])
        # Never write past the cache: a row's budget leaves room for one full verify block.
        budget = np.minimum(max_new_tokens, S - lens - Kmax - 1)
        require(bool((budget[:n] >= 1).all()), f"prompt too long for the largest cache bucket ({S} slots)")
        Tp = bk.prompt_bucket(int(lens.max()), S)
        toks = np.zeros((B, Tp), np.int32)
        for b, p in enumerate(prompts):
            toks[b, : len(p)] = p
        samp = SamplingArrays.build(sampling, B)
        greedy_only = all(s.greedy for s in sampling)
        t0 = time.perf_counter()
        # jax.device_put, not jnp.asarray: on numpy input jnp.asarray compiles a small identity
        # program per new shape, which would break "no compilation after warm-up".
        state: StepState = self._prefill_exec(B, Tp, S, greedy_only)(self.params, self.dparams, jax.device_put(toks),
                                                                    jax.device_put(lens), samp)
        pending = np.asarray(state.pending)
        t1 = time.perf_counter()
        for b, p in enumerate(prompts):
            self.drafter.start(b, list(p))
        generated: list[list[int]] = [[] for _ in range(B)]
        done = np.zeros(B, bool)
        done[n:] = True
        reason = ["length"] * B
        eos = set(self.eos_ids)

        def emit(b, new_tokens):
            for t in new_tokens:
                generated[b].append(int(t))
                if not ignore_eos and int(t) in eos:
                    done[b], reason[b] = True, "eos"
                    return
                if len(generated[b]) >= budget[b]:
                    done[b] = True
                    return

        for b in range(n):
            emit(b, [pending[b]])
            # The pending token continues the history: the first drafts must follow it.
            self.drafter.extend(b, generated[b])
        host = self.draft.kind != "model"
        # Host drafters: K is a ceiling. Each step runs the smallest precompiled bucket that
        # holds the longest proposal in the batch (K=0 when nobody proposes), because a
        # verify block costs more than a decode step even when its drafts are padding.
        usable = [k for k in self.k_buckets if k <= K] if (host and self.shrink_to_proposal) else [K]
        while not done.all():
            active = ~done
            if self.tree_mode:
                step, inputs = self._tree_proposal(B, K, S, n, greedy_only, usable, done)
            else:
                step, inputs = self._chain_proposal(B, K, S, n, greedy_only, usable, done, host)
            state, o = step(self.params, self.dparams, state, *inputs, jax.device_put(active), samp)
            toks_out, n_acc, nd = np.asarray(o.tokens), np.asarray(o.n_accepted), np.asarray(o.num_draft)
            for b in range(n):
                if not active[b]:
                    continue
                new = toks_out[b, : n_acc[b] + 1]
                before = len(generated[b])
                emit(b, new)
                stats.record(int(nd[b]), int(n_acc[b]), len(generated[b]) - before)
                # History for host drafters: the tokens now committed or pending.
                self.drafter.extend(b, generated[b][before:])
        t2 = time.perf_counter()
        for b in range(n):
            self.drafter.finish(b)
        return [GenerationResult(generated[b], reason[b], int(lens[b]), t1 - t0, t2 - t1) for b in range(n)]

    def _chain_proposal(self, B, K, S, n, greedy_only, usable, done, host):
        """The step executable and its draft inputs (draft_tokens, num_draft) for a chain step."""
        drafts: dict[int, np.ndarray] = {}
        if host and K > 0:
            for b in range(n):
                if not done[b]:
                    d = self.drafter.propose(b, K)
                    if len(d):
                        drafts[b] = d
        longest = max((len(d) for d in drafts.values()), default=0)
        k_step = next(k for k in usable if k >= longest) if host else K
        draft_tokens = np.zeros((B, max(k_step, 1)), np.int32)
        num_draft = np.zeros(B, np.int32) if host else np.full(B, K, np.int32)  # a draft model drafts K
        for b, d in drafts.items():
            draft_tokens[b, : len(d)] = d
            num_draft[b] = len(d)
        return self._step_exec(B, k_step, S, greedy_only), (jax.device_put(draft_tokens), jax.device_put(num_draft))

    def _tree_proposal(self, B, K, S, n, greedy_only, usable, done):
        """The step executable and its inputs (tokens, parents, valid) for a token-tree step.
        drafter.propose_tree(row, max_nodes) -> (parents, tokens) over the draft nodes, with
        parent -1 = the root."""
        trees = {}
        if K > 0:
            for b in range(n):
                if not done[b]:
                    parents, toks = self.drafter.propose_tree(b, K)
                    if len(toks):
                        trees[b] = (np.asarray(parents, np.int32), np.asarray(toks, np.int32))
        longest = max((len(t[1]) for t in trees.values()), default=0)
        k_step = next(k for k in usable if k >= longest)
        parents = np.zeros((B, k_step + 1), np.int32)
        parents[:, 0] = -1
        tokens = np.zeros((B, k_step + 1), np.int32)
        valid = np.zeros((B, k_step + 1), bool)
        for b, (par, toks) in trees.items():
            m = len(toks)
            parents[b, 1:m + 1] = par + 1  # draft node i is tree node i + 1; -1 (root) becomes 0
            tokens[b, 1:m + 1] = toks
            valid[b, 1:m + 1] = True
            tree.validate_parents(parents[b])  # a drafter bug must fail loudly here, not corrupt the cache
        return self._tree_step_exec(B, k_step, S, greedy_only), tuple(
            jax.device_put(a) for a in (tokens, parents, valid))
