"""SuffixDecoding (seed 001): suffix-tree drafting over the prompt, the live output and past outputs."""

from specjax.drafters.suffix.drafter import SuffixConfig, SuffixDrafter
from specjax.drafters.suffix.hybrid import HybridDrafter

__all__ = ["SuffixConfig", "SuffixDrafter", "HybridDrafter", "SuffixTrie", "Cursors", "Draft", "config", "config_of",
           "build_suffix", "build_suffix_path", "build_hybrid"]


def __getattr__(name):
    # The trie imports numba (about half a second): only when asked for (drafter.py's note).
    if name in ("SuffixTrie", "Cursors", "Draft"):
        from specjax.drafters.suffix import trie

        return getattr(trie, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def config(k: int, *, max_depth=64, alpha=1.0, min_prob=0.1, tree=True, cache_requests=100000,
           cache_mb=1024.0) -> SuffixConfig:
    """Validated before the model load (SpecjaxError on bad knobs)."""
    return SuffixConfig(max_depth=max_depth, alpha=alpha, min_prob=min_prob, tree=tree, max_spec=max(k, 1),
                        max_cached_requests=cache_requests, max_cached_mb=cache_mb)


def config_of(spec) -> SuffixConfig:
    """A DrafterSpec's suffix-tree settings."""
    return config(spec.k, max_depth=spec.suffix_max_depth, alpha=spec.suffix_alpha, min_prob=spec.suffix_min_prob,
                  tree=spec.suffix_tree, cache_requests=spec.suffix_cache_requests, cache_mb=spec.suffix_cache_mb)


def history_of(spec, tokenizer) -> list[list[int]]:
    """Past outputs for the global suffix tree (``spec.suffix_history_jsonl``: JSONL lines with
    'output_ids' or 'output' text), or none."""
    if not spec.suffix_history_jsonl:
        return []
    from specjax.jobs import read_outputs

    return [tokenizer.encode(x) if isinstance(x, str) else x
            for x in read_outputs(spec.suffix_history_jsonl, flag="--suffix_history_jsonl")]


def _suffix(model, spec, tree: bool) -> SuffixDrafter:
    import dataclasses

    cfg = config_of(spec)
    return SuffixDrafter(cfg if tree else dataclasses.replace(cfg, tree=False), history=history_of(spec, model.tokenizer))


def build_suffix(model, spec, draft=None):
    """The ``suffix`` kind (token trees, or paths with ``suffix_tree`` off) from its DrafterSpec."""
    from specjax.drafters.host import host_drafter

    return host_drafter(_suffix(model, spec, spec.suffix_tree))


def build_suffix_path(model, spec, draft=None):
    """The ``suffix_path`` kind: the suffix trees' best path, a chain."""
    from specjax.drafters.host import host_drafter

    return host_drafter(_suffix(model, spec, False))


def build_hybrid(model, spec, draft=None):
    """The ``hybrid`` kind: suffix drafts scoring above ``suffix_tau``, else prompt lookup."""
    from specjax.drafters import prompt_lookup
    from specjax.drafters.host import host_drafter
    from specjax.errors import require

    require(spec.suffix_tau >= 0, f"--suffix_tau must be >= 0, got {spec.suffix_tau}")
    pld = prompt_lookup.PromptLookupDrafter(prompt_lookup.config_of(spec))
    return host_drafter(HybridDrafter(_suffix(model, spec, spec.suffix_tree), pld, tau=spec.suffix_tau))
