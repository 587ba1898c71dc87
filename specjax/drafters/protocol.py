"""The engine's drafter protocol: everything the serving backend asks of a drafter kind.

The backend (``engine.jax_backend``) is the live state and the ``StepTable``; what differs
between drafter kinds lives behind ``Drafter``: its compile-key part (``draft``: the device draft
model its executables run, or None; ``step``: the compiled step its proposals run in), the
request lifecycle (start / extend / finish), its proposal, its step inputs, and the steps a
warm-up compiles for it. One implementation per kind: ``drafters.host.HostChain`` (prompt
lookup, suffix in path mode), ``drafters.host.HostTree`` (token trees: suffix, hybrid) and
``drafters.device.DeviceDrafter`` (draft model, layer skip; draft-ahead too). A new kind is a
subclass in its own module plus one ``registry.register_drafter`` call.

K = 0 is never a drafter's business: the backend then runs the plain chain step
(``StepInputs.plain``), the one step plain decoding has whatever the drafter (``DecodeStep``: several
of them in one call, when no decision is due between them).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Sequence

import jax
import numpy as np

from specjax import tree
from specjax.errors import require
from specjax.serving_types import Proposal, Running


class StepKind(abc.ABC):
    """One family of compiled steps (StepTable), with how its per-row inputs are passed. Kinds
    a StepJob runs also give ``empty(B, k) -> (inputs, num_draft)``: every row proposing k
    drafts, what an execute-once warm-up runs."""

    teacher = True  # its executables can return the target's top-k (online distillation)

    @abc.abstractmethod
    def exe(self, table, B: int, k: int, S: int, greedy: bool, tokens: int = 0, compile_if_missing: bool = False):
        """The compiled executable (StepTable)."""

    @abc.abstractmethod
    def args(self, inputs: tuple, num_draft, active, samp, pack) -> tuple:
        """The executable's arguments after (params, dparams, state)."""


class ChainStep(StepKind):
    """K drafts per row in a chain: passed in (``inputs`` = (tokens [B, max(K, 1)],)) or drafted
    inside the step by the table's device draft."""

    def exe(self, table, B, k, S, greedy, tokens=0, compile_if_missing=False):
        return table.step(B, k, S, greedy, tokens, compile_if_missing)

    def args(self, inputs, num_draft, active, samp, pack):
        return (inputs[0], num_draft, active, samp, None, pack)

    def empty(self, B, k):
        return (np.zeros((B, max(k, 1)), np.int32),), np.full(B, k, np.int32)


class TreeStep(StepKind):
    """A token tree of K draft nodes per row: ``inputs`` = (tokens, parents, valid) [B, K + 1],
    node 0 being each row's pending token (``tree_inputs``)."""

    teacher = False

    def exe(self, table, B, k, S, greedy, tokens=0, compile_if_missing=False):
        return table.tree_step(B, k, S, greedy, tokens, compile_if_missing)

    def args(self, inputs, num_draft, active, samp, pack):
        return (*inputs, active, samp, pack)

    def empty(self, B, k):  # a chain tree of k nodes on every row
        inputs = tree_inputs(B, k, {}, {})
        inputs[1][:, 1:] = np.arange(k)
        return inputs, np.full(B, k, np.int32)


@dataclasses.dataclass(frozen=True)
class VerifyStep(StepKind):
    """The chain step verifying K of the ``width`` drafts a device draft call left on the device:
    ``inputs`` = (tokens [B, width], their draft distributions q or None)."""

    width: int

    def exe(self, table, B, k, S, greedy, tokens=0, compile_if_missing=False):
        return table.verify(B, k, self.width, S, greedy, tokens, compile_if_missing)

    def args(self, inputs, num_draft, active, samp, pack):
        return (inputs[0], num_draft, active, samp, inputs[1], pack)


@dataclasses.dataclass(frozen=True)
class DecodeStep(StepKind):
    """Up to ``steps`` chain steps of K drafts in one call (step.spec_decode), which the backend
    runs when no decision is due between them: plain decoding at K = 0 (never a drafter's
    proposal), or, at K > 0, a drafter whose drafts are made on the device inside each step
    (``Drafter.fuses``). ``inputs`` = (tokens left [B], rows stopping at EOS [B], the EOS mask
    [vocab], the call's step limit [], whether the call ends where the first row stops []).
    ``upkeep`` False (K = 0): without a feature head's upkeep (its deferred tokens and target
    features), for a call in which no row will ever draft (all admitted with the draft
    disabled): then plain decoding's own program."""

    steps: int
    vocab: int
    upkeep: bool = True
    teacher = False

    def exe(self, table, B, k, S, greedy, tokens=0, compile_if_missing=False):
        return table.decode(B, self.steps, S, greedy, compile_if_missing, upkeep=self.upkeep, k=k)

    def args(self, inputs, num_draft, active, samp, pack):
        left, eos_rows, eos_mask, limit, stop_first = inputs
        return (active, num_draft, left, eos_rows, eos_mask, samp, limit, stop_first)

    def empty(self, B, k):
        # (K > 0: one step a row, so a warm-up's throwaway state stays within its slots)
        inputs = (np.full(B, k + 1 if k else self.steps, np.int32), np.zeros(B, bool), np.zeros(self.vocab, bool),
                  np.array(self.steps, np.int32), np.array(False))
        return inputs, np.full(B, k, np.int32)


CHAIN = ChainStep()
TREE = TreeStep()


def tree_inputs(B: int, k: int, trees: dict, row_of: dict) -> tuple:
    """(tokens, parents, valid) [B, k + 1] of the tree step for ``trees`` (uid -> DraftTree):
    node 0 is each row's pending token (the root), draft node i is tree node i + 1."""
    parents = np.zeros((B, k + 1), np.int32)
    parents[:, 0] = -1
    tokens = np.zeros((B, k + 1), np.int32)
    valid = np.zeros((B, k + 1), bool)
    for u, t in trees.items():
        row, m = row_of[u], len(t)
        if m == 0:
            continue
        parents[row, 1:m + 1] = t.parents + 1  # parent -1 (the root) becomes node 0
        tokens[row, 1:m + 1] = t.tokens
        valid[row, 1:m + 1] = True
        tree.validate_parents(parents[row])  # a drafter bug must fail loudly here, not corrupt the cache
    return tokens, parents, valid


@dataclasses.dataclass
class StepInputs:
    """What one step runs: ``kind``'s executable at ``k`` (drafts per row or tree nodes; 0: the
    plain chain step), the drafts per row and the kind's inputs (host arrays are copied to the
    device by the backend; device arrays pass as they are)."""

    kind: StepKind
    k: int
    num_draft: np.ndarray  # [B]
    inputs: tuple
    seconds: float = 0.0  # drafting done for this step before it (a draft call), charged to it

    @staticmethod
    def plain(B: int, seconds: float = 0.0) -> "StepInputs":
        inputs, num_draft = CHAIN.empty(B, 0)
        return StepInputs(CHAIN, 0, num_draft, inputs, seconds)


@dataclasses.dataclass(frozen=True)
class StepJob:
    """One compiled step a warm-up compiles (and, with execute, runs once on empty rows)."""

    kind: StepKind
    B: int
    k: int
    greedy: bool
    tokens: int = 0  # packed size (0: not packed)
    heavy = 1  # model executables (vm.max_map_count budget)

    def compile(self, be, compile_if_missing: bool = False):
        return self.kind.exe(be.table, self.B, self.k, be.slots, self.greedy, self.tokens, compile_if_missing)

    def run(self, be, state, samp):
        inputs, num_draft = self.kind.empty(self.B, self.k)
        pack = jax.device_put(np.arange(self.tokens, dtype=np.int32)) if self.tokens else None
        put = jax.device_put
        state, o = self.compile(be)(be.params, be.dparams, state, *self.kind.args(
            tuple(put(a) for a in inputs), put(num_draft), put(np.ones(self.B, bool)), samp, pack))
        jax.block_until_ready(o)
        return state


class Drafter(abc.ABC):
    """A drafter kind as the backend runs it. ``be`` (the JaxBackend) is passed where a kind
    needs the live batch: ``be.B``, ``be.row_of`` (uid -> row), ``be.k_options(B)``,
    ``be.shrink_to_proposal``, and for drafts computed on the device ``be.prepare(rs)``,
    ``be.run(exe, *args)`` (a compiled call on the live state), ``be.table``, ``be.slots``,
    ``be.sampling()``, ``be.greedy()``, ``be.to_device(a)``."""

    draft = None  # compile-key part: the device draft model its executables run (None: drafts come in)
    params = None  # that draft's params (None: it has none of its own)
    step: StepKind = CHAIN  # the compiled step its proposals (K > 0) run in
    draft_prefill = False  # admission runs a prefill of its own (a draft cache) that a request may skip
    # whether a goodput policy's default DraftPrefillGate skips that prefill where drafting does not
    # pay (a draft model's prefill is worth saving; FeatureHeadDrafter says no)
    gates_prefill = True
    max_k: int | None = None  # the most drafts (tree nodes) one step can take (usable_k_buckets); None: any
    # Its K > 0 chain steps need nothing from the host (drafted on the device inside the step), so
    # the backend may run several in one call (DecodeStep at K > 0) when no decision is due between
    fuses = False

    @property
    def plain_upkeep(self) -> bool:
        """Whether its device draft keeps up with plain steps (``ModelDraft.plain_upkeep``: a head's
        deferred window), which a decode call leaves out when no row will ever draft."""
        return bool(self.draft is not None and self.draft.plain_upkeep)

    def reset(self) -> None:
        """A new run: forget per-step state (requests are told through finish)."""

    def start(self, uid, prompt: Sequence[int]) -> None:
        """A request's prompt is in (its first token follows through extend)."""

    def extend(self, uid, tokens: Sequence[int]) -> None:
        """Tokens committed to a request."""

    def finish(self, uid) -> None:
        """A request left."""

    def forget_outputs(self) -> None:
        """Forget what finished requests taught it (a suffix tree's global cache of past outputs),
        so a benchmark's timed runs start from what a fresh process knows."""

    def tree_verified(self, rows) -> None:
        """A tree step's outcome: per row that verified nodes, (nodes verified, the accepted
        nodes' 1-based numbers in path order)."""

    @abc.abstractmethod
    def propose(self, be, rs: Sequence[Running], k_max: int, threshold: float | None = None) -> Proposal:
        """Proposals of up to ``k_max`` drafts for ``rs`` before the policy chooses
        (``threshold``: a confidence policy's cut, SmartSpec Algorithm 3)."""

    @abc.abstractmethod
    def step_inputs(self, be, rs: Sequence[Running], k: int, cap: dict) -> StepInputs:
        """The step verifying the last proposal with K = ``k``, at most ``cap[uid]`` drafts per
        request (the step runs the smallest compiled K that holds what it verifies)."""

    def warm_steps(self, B: int, ks: Sequence[int], greedy: bool, tokens, ahead: int) -> list:
        """The step jobs (StepJob or kind-specific) a warm-up compiles for K in ``ks`` (all > 0)
        at batch ``B``; ``tokens(K)``: the packed sizes; ``ahead``: the width of a draft-ahead
        call to compile too (0: none; kinds that cannot draft ahead ignore it)."""
        return [StepJob(self.step, B, K, greedy, t) for K in ks for t in (0,) + tuple(tokens(K))]


def usable_k_buckets(k_buckets: Sequence[int], drafter: Drafter) -> tuple:
    """The K buckets ``drafter``'s steps can run: those above its most drafts per step (a Medusa
    chain: its heads; a head's tree: its nodes) are not compiled, since no step could take them,
    so the default menu (0, 1, 2, 4, 8) serves a 4-head Medusa at 0, 1, 2, 4. One-line error
    when none above 0 is left."""
    ks, limit = tuple(k_buckets), drafter.max_k
    if limit is None or max(ks) <= limit:
        return ks
    kept = tuple(k for k in ks if k <= limit)
    require(len(kept) > 1, f"the {_name(drafter)} drafter takes at most {limit} drafts a step; --k_buckets "
            f"{list(ks)} has no K in 1..{limit}")
    return kept


def check_k(k: int, drafter: Drafter, flag: str) -> None:
    """One-line error when the K asked for (``flag``: the option that asked) exceeds what one of
    ``drafter``'s steps can take (usable_k_buckets did not compile it)."""
    limit = drafter.max_k
    require(limit is None or k <= limit,
            f"{flag}={k}: this drafter takes at most {limit} drafts a step ({_name(drafter)})")


def _name(drafter: Drafter) -> str:
    return getattr(drafter.draft, "label", type(drafter).__name__)
