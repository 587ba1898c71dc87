"""The frozen descriptions an engine is built from.

``DrafterSpec`` says which drafter proposes and with what knobs; ``specjax.registry`` turns it
(with a loaded model) into the drafter object the backend runs. Launch flags, the Python API and
checkpoints all produce these, so a drafter's settings and their validation exist once.
"""

from __future__ import annotations

import dataclasses

from specjax.errors import require


@dataclasses.dataclass(frozen=True)
class DrafterSpec:
    """name: a registered drafter (registry.DRAFTERS). k: the most drafts (or tree nodes) one
    step may verify (the largest K bucket). The other fields are read only by the drafters that
    name them in their registry entry's ``reads``."""

    name: str = "none"
    k: int = 4
    # device drafters
    draft_model: str | None = None  # draft_model: a model name, .gguf file or HF directory
    draft_layers: int = 8  # layer_skip: the target's first N layers
    draft_checkpoint: str | None = None  # a distilled draft's checkpoint directory
    # prompt lookup (and the hybrid's fallback)
    pld_min_ngram: int = 1
    pld_max_ngram: int = 3
    pld_max_draft: int = 0  # 0 = k
    # suffix trees (suffix, suffix_path, hybrid)
    suffix_max_depth: int = 64
    suffix_alpha: float = 1.0
    suffix_min_prob: float = 0.1
    suffix_tree: bool = True
    suffix_tau: float = 1.0
    suffix_cache_requests: int = 100000
    suffix_cache_mb: float = 1024.0
    suffix_history_jsonl: str | None = None

    def __post_init__(self):
        require(self.k >= 0, f"the draft budget k must be >= 0, got {self.k}")
