"""Distilling drafts from the target's own signals (seed 003: Online Speculative Decoding)."""
