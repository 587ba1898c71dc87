"""SuffixDecoding (seed 001): suffix-tree drafting over the prompt, the live output and past outputs."""

from specjax.drafters.suffix.drafter import SuffixConfig, SuffixDrafter
from specjax.drafters.suffix.hybrid import HybridDrafter

__all__ = ["SuffixConfig", "SuffixDrafter", "HybridDrafter", "SuffixTrie", "Cursors", "Draft"]


def __getattr__(name):
    # The trie imports numba (about half a second): only when asked for (drafter.py's note).
    if name in ("SuffixTrie", "Cursors", "Draft"):
        from specjax.drafters.suffix import trie

        return getattr(trie, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
