"""The knobs of a serving backend, once: ``JaxBackend`` takes them and ``SpecGenerator`` passes
them through to its backends; and the one preparation of the target's params for a forward."""

from __future__ import annotations

import dataclasses

from specjax import buckets as bk
from specjax.errors import require
from specjax.models import llama
from specjax.models.options import ForwardOptions
from specjax.sharding import Layout


DEFAULT_DECODE_STEPS = 16  # K = 0 steps per decode call where nothing decides between them


@dataclasses.dataclass(frozen=True)
class BackendOptions:
    k_buckets: tuple = (0, 1, 2, 4, 8)  # compiled drafts per row (or tree nodes); 0 = plain decoding
    batch_buckets: tuple = (1, 2, 4, 8)
    fwd: ForwardOptions = ForwardOptions()
    # host drafts run the smallest compiled block holding the longest proposal (False: always
    # the chosen K, for measuring a fixed block's cost)
    shrink_to_proposal: bool = True
    draft_first: bool = False  # compile a device drafter's draft-ahead path (confidence policies, Algorithm 3)
    # verify blocks of per-row draft counts run their real tokens only (buckets.token_buckets):
    # per-request K then costs what it verifies
    packed: bool = False
    prefill_chunk: int = bk.DEFAULT_PREFILL_CHUNK  # prompts run in chunks of at most this
    teacher_topk: int = 0  # chain steps also return the target's top-k (online distillation)
    layout: Layout | None = None  # shard over a mesh (params placed by its rules); None: one device
    shrink_patience: int = 8  # steps a batch must fit a smaller bucket before it is compacted
    # K = 0 steps one decode call may run (step.spec_decode), when the policy has no decision due
    # between them (plain decoding never decides; SmartSpec commits to runs of K = 0 once it keeps
    # choosing it); 1: every step its own call; None: DEFAULT_DECODE_STEPS where a call can run
    # them (one device, no teacher signal), else 1
    decode_steps: int | None = None
    # requests one prefill call runs (a prefill job's rows); None: the rule in prefill_rows_on
    prefill_rows: int | None = None
    # a prefill chunk as one program per layer-sized part, called L + 2 times (StepTable's
    # layered_prefill); None: the rule in prefill_by_layer_on
    prefill_by_layer: bool | None = None
    # prefix caching (engine.prefix_store): MiB of prefilled prompt chunks kept for prompts that
    # repeat them; 0 turns it off (outputs are the same either way)
    prefix_cache_mb: float = bk.DEFAULT_PREFIX_CACHE_MB
    # ... and, on request, the full chunks of a finished request's prompt + output, taken from its
    # row (prefix_store.after_output: a conversation's next turn; KV from decode steps, equal to
    # a prefill's to rounding only, hence off by default); plain decoding and host drafters
    prefix_cache_outputs: bool = False
    # a step a caller would wait to compile first runs as its stand-in, the same step with the
    # layers as one loop over the rows kernel's stacks (StepTable.stand_in: the same bits, compiled
    # in seconds), while the step compiles behind it; None: on where it can be (the rows kernel on
    # one CPU device, the per-layer list)
    stand_ins: bool | None = None

    def __post_init__(self):
        require(0 in self.k_buckets, "k_buckets must include 0 (plain decoding)")
        object.__setattr__(self, "k_buckets", tuple(sorted({int(k) for k in self.k_buckets})))
        object.__setattr__(self, "batch_buckets", tuple(sorted({int(b) for b in self.batch_buckets})))
        n = self.decode_steps
        require(n is None or n >= 1, f"decode_steps must be >= 1, got {n}")
        require(self.prefill_rows is None or self.prefill_rows >= 1,
                f"prefill_rows must be >= 1, got {self.prefill_rows}")
        require(self.prefix_cache_mb >= 0, f"prefix_cache_mb must be >= 0, got {self.prefix_cache_mb}")
        require(not self.prefix_cache_outputs or self.prefix_cache_mb > 0,
                "prefix_cache_outputs stores outputs in the prefix cache: give it a budget (prefix_cache_mb > 0)")
        require(n is None or n == 1 or not (self.teacher_topk or self.layout is not None),
                "decode_steps > 1 runs on one device without a teacher signal (no layout, no teacher_topk)")

    def stand_ins_on(self, platform: str) -> bool:
        """``stand_ins`` resolved (None: the rule above)."""
        possible = bool(self.fwd.rows_kernel) and not self.fwd.scan_layers and self.layout is None
        require(possible or not self.stand_ins, "stand-in steps need the rows kernel on one device and the per-layer "
                "list of layers (not scan_layers)")
        return possible and platform == "cpu" if self.stand_ins is None else self.stand_ins

    def plain_decode_steps(self) -> int:
        """``decode_steps`` resolved (None: the default rule above)."""
        if self.decode_steps is not None:
            return self.decode_steps
        return DEFAULT_DECODE_STEPS if not self.teacher_topk and self.layout is None else 1

    def prefill_rows_on(self, platform: str) -> int:
        """``prefill_rows`` resolved (None: 1 on a CPU, else the largest batch bucket). A CPU's
        prefill chunk is compute-bound per row, so batching prompts saves nothing and pads each to
        the longest, and one prompt per call needs one prefill program per chunk size instead of
        one per (batch bucket, chunk size): a cold job compiles 3 where it compiled 7. An
        accelerator's short prefills are bound by the weight reads, which a batch shares."""
        if self.prefill_rows is not None:
            return self.prefill_rows
        return 1 if platform == "cpu" else self.batch_buckets[-1]

    def prefill_by_layer_on(self, platform: str) -> bool:
        """``prefill_by_layer`` resolved (None: on a CPU wherever a layered prefill runs: one device,
        the per-layer list, XLA attention in prefill). XLA:CPU compiles a 30-layer prefill program
        in 2-3 s and one layer in about a tenth of that, and a CPU prefill chunk is compute-bound,
        so the extra calls cost nothing measurable while a cold job's first admission, which needs
        several chunk sizes, waits seconds less (BENCHMARKS.md)."""
        possible = layered_prefill_runs(self.fwd, self.layout)
        if self.prefill_by_layer is not None:
            require(possible or not self.prefill_by_layer, "prefill_by_layer runs on one device with the per-layer "
                    "list of layers and XLA attention in prefill")
            return self.prefill_by_layer
        return possible and platform == "cpu"

    def knobs(self, **changes) -> dict:
        """These options as keyword arguments (with ``changes``)."""
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, **changes}


def layered_prefill_runs(fwd: ForwardOptions, layout: Layout | None) -> bool:
    """Whether a prefill can run layer by layer (StepTable's layered_prefill): one device, the
    per-layer list of layers and XLA attention in prefill (the layer index is a run-time value)."""
    return layout is None and not fwd.scan_stacked and fwd.for_prefill().attention == "xla"


def model_params(cfg, params, fwd: ForwardOptions, draft_params=None):
    """The target's params in the form ``fwd`` runs: the layers as one scanned stack
    (``scan_layers``; drafts keep their list form) and packed copies of the weights for the CPU
    rows kernel. Idempotent, so a generator's backends share what it prepared once."""
    if fwd.scan_stacked:
        require(draft_params is not params, "a draft sharing the target's params (the same pytree) cannot run "
                "beside a scanned target; pass the draft its own params")
        params = llama.stack_layers(params)
    return llama.pack_for_rows(params, cfg) if fwd.rows_kernel else params
