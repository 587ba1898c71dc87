"""SuffixDecoding (seed 001): suffix-tree drafting over the prompt, the live output and past outputs."""

from specjax.drafters.suffix.drafter import SuffixConfig, SuffixDrafter
from specjax.drafters.suffix.hybrid import HybridDrafter
from specjax.drafters.suffix.trie import Cursors, Draft, SuffixTrie

__all__ = ["SuffixConfig", "SuffixDrafter", "HybridDrafter", "SuffixTrie", "Cursors", "Draft"]
