"""The table of drafter kinds: the one place that knows which kinds exist and what each is.

An entry names its kind, how to build it (``build(model, spec, draft=None)`` -> a
``drafters.protocol.Drafter``, given as a callable or a ``"module:function"`` path imported on
first use, so this module stays free of JAX), and the facts the launch scripts, the engine spec
and the performance models ask about it. Every kind, built-in or not, is one
``register_drafter`` call; the built-in ones are registered at the end of this module exactly as
an outside kind registers itself from its own module. Nothing else tests a drafter's name.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

TARGET_ONLY = "prompt_lookup"  # the host drafter launch/profile.py times the target-only steps with


@dataclasses.dataclass(frozen=True)
class DrafterEntry:
    """One drafter kind.

    build: ``build(model, spec: engine.spec.DrafterSpec, draft=None)`` -> the Drafter the backend
    runs (``draft``: an already loaded draft model), or a ``"module:function"`` path to it; None:
    no drafter (plain decoding). device: it drafts inside the compiled step, so its steps need a
    performance model of their own. reads: the DrafterSpec fields it uses (a setting given for a
    kind that does not read it is refused). trains: launch/distill.py can train its draft. head:
    a feature head (``drafters.heads.HeadKind``, as ``"module:KIND"``): trained by the head
    pipeline and refined online by distill.head_online. draft_ahead: it can draft ahead of the
    policy's choice (confidence policies). host_kernels: ``"module:function"`` compiling its host
    kernels (suffix trees: numba), run beside the model load. chain: the DrafterSpec changes that
    make a tree-drafting kind draft chains (bench's ``--also_chains``). perf_label: the
    performance model its steps are costed with (``spec`` -> label; None: its name if ``device``,
    else the target-only model)."""

    name: str
    build: Callable | str | None
    device: bool = False
    reads: frozenset = frozenset()
    trains: bool = False
    head: str | None = None
    draft_ahead: bool = False
    host_kernels: str | None = None
    chain: tuple = ()
    perf_label: Callable | None = None

    def builder(self) -> Callable | None:
        return resolve(self.build)

    def head_kind(self):
        """The feature head's HeadKind (``head``), or None."""
        return resolve(self.head)

    def label(self, spec) -> str:
        """The performance-model label of ``spec`` (a DrafterSpec of this kind)."""
        if self.perf_label is not None:
            return self.perf_label(spec)
        return self.name if self.device else TARGET_ONLY


def resolve(ref):
    """A ``"module:attribute"`` path imported (anything else as it is)."""
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


DRAFTERS: dict[str, DrafterEntry] = {}


def register_drafter(entry: DrafterEntry) -> None:
    """Add a drafter kind (a new kind needs its module and this one call, nothing else)."""
    DRAFTERS[entry.name] = entry


def entry(name: str) -> DrafterEntry:
    """The registered kind ``name``, or a one-line SpecjaxError naming the kinds there are."""
    from specjax.errors import SpecjaxError

    e = DRAFTERS.get(name)
    if e is None:
        raise SpecjaxError(f"unknown drafter {name!r}; use one of {', '.join(DRAFTERS)}")
    return e


def names(**facts) -> tuple[str, ...]:
    """The registered kinds whose entries have these facts (e.g. ``names(device=True)``;
    ``head=True``: the feature heads; ``build=True``: every kind that drafts)."""
    def has(e, k, v):
        got = getattr(e, k)
        return bool(got) == v if isinstance(v, bool) else got == v

    return tuple(n for n, e in DRAFTERS.items() if all(has(e, k, v) for k, v in facts.items()))


_PLD = frozenset({"pld_min_ngram", "pld_max_ngram", "pld_max_draft"})
_SUFFIX = frozenset({"suffix_max_depth", "suffix_alpha", "suffix_min_prob", "suffix_tree", "suffix_cache_requests",
                     "suffix_cache_mb", "suffix_history_jsonl"})
_SUFFIX_KERNELS = "specjax.drafters.suffix.drafter:warm_kernels"


def _draft_label(spec) -> str:  # a layer-skip draft by its layers, a draft model by its file
    if spec.name == "layer_skip":
        return f"layer_skip{spec.draft_layers}"
    return f"draft_model:{model_name(spec.draft_model)}" if spec.draft_model else spec.name


def _eagle_label(spec) -> str:  # (hybrid_eagle's steps are the head's chain steps)
    return "eagle" + (f"_tree{spec.eagle_tree_width}x{spec.eagle_tree_depth}"
                      if spec.name == "eagle" and spec.eagle_tree_width else "")


def model_name(spec: str) -> str:
    """The name a model spec loads under (LoadedModel.cfg.name): a config name as is, a .gguf
    file or HF directory by its base name."""
    import os

    return os.path.basename(os.path.normpath(spec)) if (spec.endswith(".gguf") or os.path.isdir(spec)) else spec


for _e in (
        DrafterEntry("none", None),
        DrafterEntry("prompt_lookup", "specjax.drafters.prompt_lookup:build", reads=_PLD),
        DrafterEntry("draft_model", "specjax.drafters.model_kinds:build_draft_model", device=True,
                     reads=frozenset({"draft_model", "draft_checkpoint"}), trains=True, draft_ahead=True,
                     perf_label=_draft_label),
        DrafterEntry("layer_skip", "specjax.drafters.model_kinds:build_layer_skip", device=True,
                     reads=frozenset({"draft_layers", "draft_checkpoint"}), trains=True, draft_ahead=True,
                     perf_label=_draft_label),
        DrafterEntry("eagle", "specjax.drafters.eagle:build_kind", device=True,
                     reads=frozenset({"eagle_head", "eagle_tree_width", "eagle_tree_depth"}), trains=True,
                     head="specjax.drafters.eagle:KIND", chain=(("eagle_tree_width", 0),), perf_label=_eagle_label),
        DrafterEntry("medusa", "specjax.drafters.medusa:build_kind", device=True,
                     reads=frozenset({"medusa_head", "medusa_tree"}), trains=True, head="specjax.drafters.medusa:KIND",
                     chain=(("medusa_tree", False),), perf_label=lambda s: "medusa" + ("_tree" if s.medusa_tree else "")),
        DrafterEntry("suffix", "specjax.drafters.suffix:build_suffix", reads=_SUFFIX, host_kernels=_SUFFIX_KERNELS),
        DrafterEntry("suffix_path", "specjax.drafters.suffix:build_suffix_path", reads=_SUFFIX - {"suffix_tree"},
                     host_kernels=_SUFFIX_KERNELS),
        DrafterEntry("hybrid", "specjax.drafters.suffix:build_hybrid", reads=_SUFFIX | _PLD | {"suffix_tau"},
                     host_kernels=_SUFFIX_KERNELS),
        DrafterEntry("hybrid_eagle", "specjax.drafters.head_hybrid:build", device=True,
                     reads=(_SUFFIX - {"suffix_tree"}) | {"suffix_tau", "eagle_head"}, host_kernels=_SUFFIX_KERNELS,
                     perf_label=_eagle_label)):
    register_drafter(_e)
