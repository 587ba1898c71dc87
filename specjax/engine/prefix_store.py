"""Prefix caching: prefilled prompt chunks kept for the requests that repeat them.

A prompt is prefilled in the chunks ``buckets.prefill_chunks`` plans for it: full chunks of the
largest size first, then a tail. ``PrefixStore`` keeps, for chunks that were prefilled whole
(no padding), what the chunk left in its row of the prefill state (a *segment*: the chunk's KV
entries, target and draft, and the row's small state after it), in a radix tree whose edges are
chunks (size and token ids) from the prompt's start. A new prompt walks the tree along its own
chunk plan and reuses the longest path of chunks it finds, always leaving its last chunk to
compute (it samples the first token). Reuse happens only at the boundaries of the prompt's own
plan, so the chunks that do run are the same calls, on the same state, as without the store:
outputs are bit-identical (tested), whatever the drafter.

The store is host-side bookkeeping over opaque segments (the device arrays a backend captured;
``None`` in the simulator, which only needs to know what is skipped): a byte budget, least
recently used leaves evicted first (a node is evicted only after its children, so every stored
path is whole), and counts for the job summary. Entries with and without the device draft's
cache are kept apart (``run_draft``: a request admitted without the draft prefill may reuse
neither kind for the other).

Finished outputs, on request (``after_output``; BackendOptions.prefix_cache_outputs): when a
request ends, the full chunks of its prompt + output that the store lacks are taken from its
serving row, so a conversation's next turn, which resends both, prefills only what follows.
Those entries come from decode and verify steps, not from a prefill: their KV equals a
prefill's to rounding, not bit for bit, so a next turn's tokens equal a cold prefill's except
where the target's top two logits are that close; off by default for that reason.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np


@dataclasses.dataclass(eq=False)
class Node:
    key: tuple  # (chunk size, token-id bytes)
    start: int  # the chunk's first position
    segment: Any  # what the backend captured (None in the simulator)
    nbytes: int
    parent: "Node | None" = None
    children: dict = dataclasses.field(default_factory=dict)
    last_used: int = 0

    @property
    def end(self) -> int:
        return self.start + self.key[0]


def chunk_key(prompt: Sequence[int], start: int, size: int) -> tuple:
    return size, np.asarray(prompt[start:start + size], np.int32).tobytes()


@dataclasses.dataclass
class PrefixStats:
    lookups: int = 0  # prompts looked up
    hits: int = 0  # ... that reused at least one chunk
    tokens_saved: int = 0  # prompt tokens not prefilled thanks to the store
    tokens_prefilled: int = 0  # prompt tokens prefilled (padding excluded)
    inserted: int = 0  # chunks stored
    from_outputs: int = 0  # ... of them taken from finished outputs (after_output)
    evicted: int = 0  # chunks evicted

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["hit_rate"] = self.hits / self.lookups if self.lookups else 0.0
        total = self.tokens_saved + self.tokens_prefilled
        d["saved_fraction"] = self.tokens_saved / total if total else 0.0
        return d

    def line(self) -> str:
        d = self.as_dict()
        return (f"prefix cache: {self.hits}/{self.lookups} prompts hit ({d['hit_rate']:.0%}), "
                f"{self.tokens_saved} of {self.tokens_saved + self.tokens_prefilled} prompt tokens reused "
                f"({d['saved_fraction']:.0%}), {self.inserted} chunks stored"
                + (f" ({self.from_outputs} from outputs)" if self.from_outputs else "") + f", {self.evicted} evicted")


class PrefixStore:
    def __init__(self, budget_bytes: int):
        self.budget = int(budget_bytes)
        self.roots = {False: Node((0, b""), 0, None, 0), True: Node((0, b""), 0, None, 0)}
        self.nbytes = 0
        self.stats = PrefixStats()
        self._tick = 0

    def __len__(self) -> int:
        return sum(1 for _ in self._nodes())

    def _nodes(self):
        stack = [c for r in self.roots.values() for c in r.children.values()]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _touch(self, node: Node) -> None:
        self._tick += 1
        while node is not None and node.parent is not None:
            node.last_used = self._tick
            node = node.parent

    def match(self, prompt: Sequence[int], plan: Sequence[tuple[int, int]], run_draft: bool) -> list[Node]:
        """The stored chunks of ``prompt``'s own ``plan`` from its start, as long as a path
        exists and the prompt goes on past the chunk (its last chunk always runs)."""
        node, path = self.roots[bool(run_draft)], []
        for start, size in plan:
            if start + size >= len(prompt):
                break
            node = node.children.get(chunk_key(prompt, start, size))
            if node is None:
                break
            path.append(node)
        return path

    def use(self, path: Sequence[Node]) -> None:
        """Mark a matched path as used now (LRU)."""
        if path:
            self._touch(path[-1])

    def count(self, prompt_len: int, reused: int) -> None:
        """One prompt admitted: ``reused`` of its ``prompt_len`` tokens came from the store."""
        self.stats.lookups += 1
        self.stats.hits += reused > 0
        self.stats.tokens_saved += reused
        self.stats.tokens_prefilled += prompt_len - reused

    def child(self, parent: Node | None, prompt: Sequence[int], start: int, size: int, run_draft: bool) -> Node | None:
        """The stored chunk after ``parent`` (None: the root) for ``prompt``'s [start, start + size)."""
        parent = parent if parent is not None else self.roots[bool(run_draft)]
        return parent.children.get(chunk_key(prompt, start, size))

    def wants(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.budget

    def insert(self, parent: Node | None, prompt: Sequence[int], start: int, size: int, run_draft: bool,
               segment: Any, nbytes: int) -> Node | None:
        """Store the chunk [start, start + size) of ``prompt`` after ``parent`` (None: the root;
        it must be the chunk before). Evicts least recently used leaves to stay within the
        budget, never ``parent``'s path; returns the node (None if it cannot fit)."""
        parent = parent if parent is not None else self.roots[bool(run_draft)]
        if not self._attached(parent):
            return None  # (evicted since the job read it: its chunks are no longer a stored path)
        key = chunk_key(prompt, start, size)
        node = parent.children.get(key)
        if node is not None:
            self._touch(node)
            return node
        if not self.wants(nbytes) or not self._make_room(nbytes, keep=parent):
            return None
        node = parent.children[key] = Node(key, start, segment, int(nbytes), parent)
        self.nbytes += node.nbytes
        self.stats.inserted += 1
        self._touch(node)
        return node

    def _attached(self, node: Node) -> bool:
        while node.parent is not None:
            if node.parent.children.get(node.key) is not node:
                return False
            node = node.parent
        return any(node is r for r in self.roots.values())

    def _make_room(self, nbytes: int, keep: Node) -> bool:
        protected = set()
        n = keep
        while n is not None:
            protected.add(id(n))
            n = n.parent
        while self.nbytes + nbytes > self.budget:
            leaves = [n for n in self._nodes() if not n.children and id(n) not in protected]
            if not leaves:
                return False
            self._remove(min(leaves, key=lambda n: n.last_used))
        return True

    def _remove(self, node: Node) -> None:
        del node.parent.children[node.key]
        self.nbytes -= node.nbytes
        node.segment = None
        self.stats.evicted += 1

    def clear(self, run_draft: bool | None = None) -> None:
        """Forget every entry (``run_draft``: only those with / without the draft's cache, e.g.
        after the draft's params changed)."""
        for rd in (False, True) if run_draft is None else (bool(run_draft),):
            stack = list(self.roots[rd].children.values())
            while stack:
                n = stack.pop()
                stack.extend(n.children.values())
                self.nbytes -= n.nbytes
                n.segment = None
            self.roots[rd].children.clear()


def start_job(store: PrefixStore | None, job) -> list[list[Node]]:
    """Before a prefill job (engine.prefill_jobs.PrefillJob) runs: the stored chunks every row
    of it has, from the start of the job's plan (the run all its rows share); the job then starts
    after them (``job.next``) and ``job.nodes`` holds each row's last chunk. Returns each row's
    chunks to restore (the backend writes their segments into its prefill state)."""
    job.nodes = [None] * len(job.rs)
    if store is None:
        return [[] for _ in job.rs]
    paths = [store.match(r.req.prompt, job.plan, job.run_draft) for r in job.rs]
    n = min(len(p) for p in paths)
    for b, (r, p) in enumerate(zip(job.rs, paths)):
        store.count(len(r.req.prompt), p[n - 1].end if n else 0)
        store.use(p[:n])
        job.nodes[b] = p[n - 1] if n else None
    job.next = n
    return [p[:n] for p in paths]


def after_chunk(store: PrefixStore | None, job, start: int, size: int, n_valid: Sequence[int], nbytes: int,
                capture) -> None:
    """After a job's chunk [start, start + size) ran: each row whose chunk was whole (no padding)
    and whose earlier chunks are stored gets this one stored too, ``capture(b)`` giving row b's
    segment (called only for chunks not stored yet)."""
    if store is None:
        return
    for b, r in enumerate(job.rs):
        parent = job.nodes[b]
        if n_valid[b] != size or (start > 0 and parent is None):
            job.nodes[b] = None  # (the row's stored path ends here)
            continue
        node = store.child(parent, r.req.prompt, start, size, job.run_draft)
        if node is None and store.wants(nbytes):
            node = store.insert(parent, r.req.prompt, start, size, job.run_draft, capture(b), nbytes)
        job.nodes[b] = node


def after_output(store: PrefixStore | None, seq: Sequence[int], kv_len: int, size: int, nbytes: int, capture) -> int:
    """After a request finished whose row holds the KV of ``seq[:kv_len]`` (its prompt and all
    but its last output token): store the chunks of ``size`` tokens from ``seq``'s start that lie
    within ``kv_len`` and are not stored yet (a prompt's plan runs full chunks of its largest size
    first, so a longer prompt that starts with ``seq`` walks these), ``capture(start)`` giving
    the row's segment of [start, start + size). Only entries without a draft cache. Returns the
    chunks stored."""
    if store is None or not store.wants(nbytes):
        return 0
    node, stored = None, 0
    for start in range(0, kv_len - size + 1, size):
        child = store.child(node, seq, start, size, False)
        if child is None:
            child = store.insert(node, seq, start, size, False, capture(start), nbytes)
            if child is None:
                break
            stored += 1
        node = child
    store.use([node] if node is not None else [])  # (the path's last chunk: its ancestors too)
    store.stats.from_outputs += stored
    return stored
