"""Static-batch speculative generation: a facade over the serving engine.

``SpecGenerator.generate`` submits every prompt at t = 0 to a ``ServingEngine`` over a
``JaxBackend`` under a fixed policy (K drafts per step; host drafts shrink the block to the
longest proposal) or a given one, so one loop serves the Python API, the launch scripts and
serving. One backend is kept per cache-slot bucket, each calling one ``StepTable`` of compiled
executables; ``warmup`` compiles every variant the configured buckets allow, after which
generation only calls compiled executables (and raises instead of compiling for a shape that
was not warmed up). Generators that differ only in their host drafter can share one set of
tables (``share_compiled``), so a benchmark of several drafters or policies compiles once.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from typing import Literal, Sequence

from specjax.config import ModelConfig
from specjax.drafters.kinds import as_drafter
from specjax.drafters.protocol import check_k, usable_k_buckets
from specjax.device_arrays import check_same_avals, param_avals
from specjax.engine.jax_backend import JaxBackend
from specjax.engine.loop import ServingEngine
from specjax.engine.options import BackendOptions, model_params
from specjax.engine.scheduler import Request
from specjax.engine.table import StepTable
from specjax.drafters.device import ModelDraft, check_pair
from specjax.errors import SpecjaxError, require
from specjax.results import GenerationResult, check_max_new_tokens, validate_request
from specjax.goodput.acceptance import AcceptanceCounts
from specjax.goodput.selector import DraftPrefillGate, FixedK, GoodputPolicy, Policy
from specjax.sampling import SamplingParams


# vLLM-style speculative metrics over generate calls (``generate(stats=...)`` adds each call's
# engine counts): the one AcceptanceCounts, under the name the Python API and launch scripts use.
SpecStats = AcceptanceCounts


class _Compiled:
    """Compiled executables of one (model, device draft, forward options): a StepTable per
    cache-slot bucket and whether they are frozen (warm: a missing shape raises)."""

    def __init__(self):
        self.tables: dict[int, StepTable] = {}
        self.warm = False


class SpecGenerator:
    def __init__(self, cfg: ModelConfig, params, *, eos_ids: Sequence[int] = (), drafter=None,
                 draft: ModelDraft | None = None, draft_params=None,
                 slot_buckets: Sequence[int] = (256, 512, 1024, 2048), **options):
        """``drafter`` / ``draft`` + ``draft_params``: as for JaxBackend; ``options``: the
        BackendOptions every cache-slot bucket's backend runs with."""
        self.options = BackendOptions(**options)
        self.cfg = cfg
        self.drafter = as_drafter(drafter, draft, draft_params)
        self.options = dataclasses.replace(self.options,
                                           k_buckets=usable_k_buckets(self.options.k_buckets, self.drafter))
        check_pair(cfg, self.drafter.draft, self.drafter.params)
        self.params = model_params(cfg, params, self.options.fwd, self.drafter.params)  # (once for every backend)
        self.dparams = self.drafter.params if self.drafter.params is not None else self.params
        self.eos_ids = tuple(int(e) for e in eos_ids)
        self.k_buckets = self.options.k_buckets
        self.batch_buckets = self.options.batch_buckets
        self.slot_buckets = tuple(sorted(s for s in slot_buckets if s <= cfg.max_position)) or (cfg.max_position,)
        self.shrink_to_proposal = self.options.shrink_to_proposal
        self._backends: dict[int, JaxBackend] = {}
        self._compiled = _Compiled()
        # Prefill gates created for GoodputPolicy objects (see generate), one per policy object.
        self._gates: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.last_engine: ServingEngine | None = None  # the engine of the last generate call (steps, stats)
        self.last_draft_prefill: bool | None = None  # device drafters: did its admission run the draft prefill

    def swap_draft_params(self, new) -> None:
        """Generate with the device draft on ``new`` from the next call on (the same tree, shapes
        and dtypes; nothing recompiles; JaxBackend.swap_draft_params)."""
        require(self.drafter.params is not None, "this generator has no device draft whose params could be swapped")
        check_same_avals(self.dparams, new, "new draft params")
        self.dparams = new
        for be in self._backends.values():
            be.swap_draft_params(new)

    def backend(self, slots: int) -> JaxBackend:
        """The engine backend of one cache-slot bucket (created on first use)."""
        be = self._backends.get(slots)
        if be is None:
            # A static batch never compacts: rows of finished requests just idle until the end
            # (a resize copies the whole cache), as the batch they started in.
            be = self._backends[slots] = JaxBackend(self.cfg, self.params, drafter=self.drafter, slots=slots,
                                                    **self.options.knobs(shrink_patience=1 << 30))
            if self.drafter.params is not None and self.dparams is not self.drafter.params:
                be.swap_draft_params(self.dparams)  # (swapped before this bucket's backend existed)
            shared = next((b.prefix for b in self._backends.values() if b is not be and b.prefix is not None), None)
            if shared is not None:  # (after the swap: the shared store's entries are the current draft's)
                be.share_prefix(shared)  # one prefix store for every slot bucket
            # (the backend's own fresh table is dropped when this slot bucket already has one)
            be.table = self._compiled.tables.setdefault(slots, be.table)
            be.table.warm = self._compiled.warm
        be.shrink_to_proposal = self.shrink_to_proposal
        return be

    @property
    def prefix_stats(self):
        """The prefix store's counts (engine.prefix_store.PrefixStats; None with the store off)."""
        be = next(iter(self._backends.values()), None)
        return None if be is None or be.prefix is None else be.prefix.stats

    def _compile_signature(self):
        return (self.cfg, self.drafter.draft, self.options.fwd, param_avals(self.params),
                param_avals(self.dparams) if self.drafter.params is not None else None)

    def share_compiled(self, other: "SpecGenerator") -> None:
        """Call ``other``'s compiled executables from now on (and compile into them). A step's code
        depends on the model, the device draft and the forward options, never on a host drafter
        or a policy, so generators that differ only in those can share it: fewer compilations
        and fewer memory maps (each XLA:CPU executable holds hundreds). Raises SpecjaxError if
        the two would not compile the same code."""
        if other._compiled is self._compiled:
            return
        if self._compile_signature() != other._compile_signature():
            raise SpecjaxError("share_compiled: the generators differ in model, device draft, parameter shapes "
                               "or forward options, so their executables differ")
        self._compiled = other._compiled
        self._backends.clear()

    # ------------------------------------------------------------ compilation

    @property
    def warm(self) -> bool:
        return self._compiled.warm

    @warm.setter
    def warm(self, value: bool) -> None:
        """True: every backend refuses to compile (a missing shape raises); shared with the
        generators of share_compiled."""
        self._compiled.warm = bool(value)
        for t in self._compiled.tables.values():
            t.warm = self._compiled.warm

    def warmup(self, prompt_lens: Sequence[int] = (16, 32, 64, 128, 256), greedy_modes=(True, False),
               batch_buckets: Sequence[int] | None = None, slot_buckets: Sequence[int] | None = None,
               k_buckets: Sequence[int] | None = None, execute: bool = False, later_ks: Sequence[int] = (),
               later_after_steps: int = 0, lazy: bool = False) -> float:
        """Compile every (batch, K, slots, mode) step and the (batch, chunk, slots, mode) prefill
        chunks of prompts of these lengths (and the row operations a static batch uses);
        ``execute``: also run each once; ``later_ks``: these K buckets compile in the background
        and join the policy's options when ready, starting after ``later_after_steps`` steps
        (JaxBackend.warmup; ``stop_later`` ends it); ``lazy``: compile each executable on first
        use and the rest ahead in the background (JaxBackend.warmup). Returns seconds."""
        t0 = time.perf_counter()
        for S in slot_buckets or self.slot_buckets:
            be = self.backend(S)
            be.table.warm = False
            lens = [p for p in prompt_lens if p <= S]
            be.warmup(prompt_lens=lens, greedy_modes=greedy_modes, batch_buckets=batch_buckets, k_buckets=k_buckets,
                      execute=execute, later_ks=later_ks, later_after_steps=later_after_steps, lazy=lazy,
                      queue=lens if lazy else ())
        self.warm = True
        return time.perf_counter() - t0

    def k_options(self) -> list[int]:
        """The K buckets every slot bucket's backend can run now (see JaxBackend.k_options)."""
        ready = [set(be.k_options(be.B or 1)) for be in self._backends.values()]
        return sorted(set.intersection(*ready)) if ready else list(self.k_buckets)

    def compile_waits(self) -> tuple[float, float]:
        """Seconds generation waited for executables compiled (or loaded) on first use, during
        prefills and in all (a lazy warm-up's; JaxBackend.waited)."""
        w = [be.waited() for be in self._backends.values()]
        return sum(p for p, _ in w), sum(a for _, a in w)

    def stop_later(self) -> list[int]:
        """End background compilation (warmup's ``later_ks``) after the executable in progress;
        returns the K buckets left uncompiled."""
        return sorted({k for be in self._backends.values() for k in be.stop_later()})

    # ------------------------------------------------------------ generation

    def slots_for(self, prompt_lens: Sequence[int], max_new_tokens: int) -> int:
        """The cache-slot bucket a batch of these prompts runs in: room for the longest prompt,
        its new tokens and one full verify block, else the largest bucket."""
        need = max(prompt_lens) + max_new_tokens + max(self.k_buckets) + 1
        return next((s for s in self.slot_buckets if s >= need), self.slot_buckets[-1])

    def prefill_gate_for(self, policy: Policy, prefill_gate=None) -> DraftPrefillGate | None:
        """The gate ``generate`` uses (see there): None without a device drafter or when off."""
        if not self.drafter.draft_prefill or prefill_gate is False:
            return None
        if prefill_gate is not None:
            return prefill_gate
        if not isinstance(policy, GoodputPolicy) or not self.drafter.gates_prefill:
            return None  # a fixed K has nothing to learn; K = 0 skips the draft prefill anyway
        gate = self._gates.get(policy)
        if gate is None:
            gate = self._gates[policy] = DraftPrefillGate()
        return gate

    def generate(self, prompts: Sequence[Sequence[int]], sampling=SamplingParams(), max_new_tokens: int = 128,
                 num_spec_tokens: int = 4, ignore_eos: bool = False, stats: SpecStats | None = None,
                 policy: Policy | None = None,
                 prefill_gate: DraftPrefillGate | None | Literal[False] = None) -> list[GenerationResult]:
        """``policy``: how many drafts each step verifies (default: fixed K = ``num_spec_tokens``;
        a ``GoodputPolicy`` chooses among every compiled K, learning acceptance across calls).
        ``prefill_gate`` (device drafters only): requests are admitted without the draft prefill,
        and then never draft, when the gate has seen mostly K = 0 steps. None: a GoodputPolicy
        gets a gate of its own that persists across calls with that policy object (once the
        policy has learnt that drafts do not pay, later prompts skip the draft prefill, as a
        server's would), unless the drafter's prefill is not worth gating (``gates_prefill``: a
        feature head's); False: never skip it; or a given DraftPrefillGate.
        Whatever the policy and the gate, greedy outputs are the target's own."""
        if isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompts)
        require(len(sampling) == len(prompts), "one SamplingParams per prompt")
        require(all(isinstance(s, SamplingParams) for s in sampling),
                "sampling must be a SamplingParams or one SamplingParams per prompt")
        check_max_new_tokens(max_new_tokens)
        check_k(num_spec_tokens, self.drafter, "num_spec_tokens")
        require(num_spec_tokens in self.k_buckets,
                f"num_spec_tokens={num_spec_tokens} is not a precompiled K bucket {list(self.k_buckets)}"
                if num_spec_tokens <= max(self.k_buckets) else
                f"num_spec_tokens={num_spec_tokens} exceeds the largest K bucket {max(self.k_buckets)}")
        for p in prompts:
            validate_request(p, max_new_tokens, self.cfg)
        if not prompts:
            return []
        S = self.slots_for([len(p) for p in prompts], max_new_tokens)
        reqs = []
        for i, (p, s) in enumerate(zip(prompts, sampling)):
            # Never write past the cache: a row's budget leaves room for one full verify block.
            budget = min(max_new_tokens, S - len(p) - max(self.k_buckets) - 1)
            require(budget >= 1, f"prompt too long for the largest cache bucket ({S} slots)")
            reqs.append(Request(str(i), list(p), budget, s, 0.0, ignore_eos))
        be = self.backend(S)
        be.reset()
        pol = policy if policy is not None else FixedK(num_spec_tokens)
        gate = self.prefill_gate_for(pol, prefill_gate)
        engine = ServingEngine(be, pol, eos_ids=self.eos_ids, prefill_gate=gate)
        self.last_engine = engine
        outs = engine.run(reqs)
        self.last_draft_prefill = None if not self.drafter.draft_prefill else engine.draft_prefills > 0
        for o in outs:
            if o.error is not None:
                raise SpecjaxError(o.error)
        if stats is not None:
            stats.merge(engine.counts)
        return [GenerationResult(o.tokens, o.finish_reason, o.prompt_len, o.first_token - o.admitted,
                                 o.finished - o.first_token) for o in outs]
