"""Several drafts, each learning one slice of the query distribution (seed 003, section 5.2: a
draft per language or per topic, all verified by one target).

A router says which draft serves a request:

- ``TagRouter``: by the request's tag (``Request.tag``, the client's label: a product surface, a
  language); an unknown or missing tag goes to draft 0.
- ``CentroidRouter``: a small classifier built here, nearest centroid (cosine) over hashed
  token unigrams and bigrams of the prompt, weighted by their inverse document frequency over
  the prompts seen so far (a chat template's tokens, in every prompt, weigh nothing). Tagged
  requests train it (their tag's draft is the class; ``tags`` names the first classes) and the
  others are classified; the classes beyond the tags are online k-means clusters: a prompt
  unlike every centroid so far (cosine below ``seed_below``) seeds the next empty one, and every
  routed prompt pulls its centroid toward it (running mean).

``MultiDraft`` serves them on one backend (``ServingEngine(drafts=...)``: a batch runs one
draft, the engine switches between batches) with an ``OnlineDistiller`` per draft, so each has
its own replay buffer, optimizer, checkpoints and policy (its own acceptance estimate). The
router's state goes into every draft's checkpoint record and comes back on resume.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from specjax.errors import require

FEATURE_DIM = 2048


def features(prompt: Sequence[int], dim: int = FEATURE_DIM) -> np.ndarray:
    """Hashed counts of the prompt's token unigrams and bigrams, L2-normalised: [dim] float32."""
    t = np.asarray(prompt, np.int64)
    keys = np.concatenate([t * 0x9E3779B1, t[:-1] * 0x85EBCA77 + t[1:] * 0xC2B2AE3D + 1])
    f = np.bincount((keys % dim).astype(np.int64), minlength=dim).astype(np.float32)
    return _unit(f)


def _unit(x: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.maximum(n, 1e-12)


class TagRouter:
    def __init__(self, tags: Sequence[str]):
        require(len(tags) >= 1 and len(set(tags)) == len(tags), "TagRouter needs distinct tags, one per draft")
        self.tags = list(tags)
        self.index = {t: i for i, t in enumerate(self.tags)}

    @property
    def n(self) -> int:
        return len(self.tags)

    def route(self, prompt, tag: str | None = None) -> int:
        return self.index.get(tag, 0)

    def state(self) -> dict:
        return {"kind": "tag", "tags": self.tags, "docs": 0}

    def load(self, state: dict) -> None:
        require(state.get("kind") == "tag" and state.get("tags") == self.tags,
                f"the checkpoint's router ({state}) is not this one (tags {self.tags})")


class CentroidRouter:
    def __init__(self, n: int, tags: Sequence[str] = (), dim: int = FEATURE_DIM, seed_below: float = 0.3):
        require(n >= 1, f"a router needs at least one draft, got {n}")
        require(len(tags) <= n and len(set(tags)) == len(tags), f"at most {n} distinct tags, got {list(tags)}")
        self.n, self.dim, self.seed_below = n, dim, seed_below
        self.tags = list(tags)
        self.centroids = np.zeros((n, dim), np.float32)  # running means of unweighted features
        self.counts = np.zeros(n, np.int64)
        self.df = np.zeros(dim, np.int64)  # prompts with each feature
        self.docs = 0

    def _observe(self, f: np.ndarray, g: int) -> None:
        self.counts[g] += 1
        self.centroids[g] += (f - self.centroids[g]) / self.counts[g]

    def route(self, prompt, tag: str | None = None) -> int:
        f = features(prompt, self.dim)
        self.df += f > 0
        self.docs += 1
        if tag in self.tags:  # a labelled example: its class, and the classifier learns it
            g = self.tags.index(tag)
        else:
            seen = np.flatnonzero(self.counts)
            if len(seen) == 0:
                g = 0
            else:
                idf = np.log((1.0 + self.docs) / (1.0 + self.df)).astype(np.float32)
                sims = _unit(self.centroids[seen] * idf) @ _unit(f * idf)
                free = [c for c in np.flatnonzero(self.counts == 0) if c >= len(self.tags)]  # (not a tag's class)
                g = int(free[0]) if (free and sims.max() < self.seed_below) else int(seen[np.argmax(sims)])
        self._observe(f, g)
        return g

    def state(self) -> dict:
        return {"kind": "centroid", "n": self.n, "dim": self.dim, "tags": self.tags,
                "seed_below": self.seed_below, "counts": self.counts.tolist(), "df": self.df.tolist(),
                "docs": self.docs, "centroids": [[round(float(x), 6) for x in row] for row in self.centroids]}

    def load(self, state: dict) -> None:
        require(state.get("kind") == "centroid" and state.get("n") == self.n and state.get("dim") == self.dim
                and state.get("tags") == self.tags, "the checkpoint's router is not this one "
                f"({state.get('kind')}, {state.get('n')} drafts, tags {state.get('tags')})")
        self.counts = np.asarray(state["counts"], np.int64)
        self.df, self.docs = np.asarray(state["df"], np.int64), int(state["docs"])
        self.centroids = np.asarray(state["centroids"], np.float32)


class MultiDraft:
    """``distillers[g]`` (distill.online.OnlineDistiller, all on one backend, each with its own
    self-draft and policy) serves the requests ``router`` sends to draft g."""

    def __init__(self, router, distillers: Sequence):
        require(len(distillers) == router.n, f"the router has {router.n} drafts, {len(distillers)} distillers given")
        backends = {id(d.backend) for d in distillers}
        require(len(backends) == 1, "the drafts of a MultiDraft share one backend")
        self.router, self.distillers = router, list(distillers)
        self.backend = distillers[0].backend
        self.of: dict = {}  # request id -> draft
        self.active: int | None = None
        for d in self.distillers:
            d.serving = False
            d.extra_record = lambda: {"router": self.router.state()}

    def expect(self, requests: Sequence) -> None:
        """Route requests about to be served (in order) and hand their prompts to their drafts."""
        for r in requests:
            g = self.of[r.id] = self.router.route(r.prompt, r.tag)
            self.distillers[g].expect([r])

    def group(self, req) -> int:
        return self.of[req.id]

    def activate(self, g: int):
        for i, d in enumerate(self.distillers):
            d.serving = i == g
        d = self.distillers[g]
        self.backend.swap_draft_params(d.draft.params(d.trainable))
        self.active = g
        return d.policy

    def on_finish(self, out) -> None:
        self.distillers[self.of.pop(out.id)].on_finish(out)

    def on_step(self, engine) -> None:
        if self.active is not None:
            self.distillers[self.active].on_step(engine)

    def save(self) -> list:
        return [d.save() for d in self.distillers]

    def resume(self) -> list:
        """Each draft from its latest checkpoint; the router from the newest record among them."""
        steps = [d.resume() for d in self.distillers]
        recs = [d.resumed_record for d in self.distillers if d.resumed_record and "router" in d.resumed_record]
        if recs:
            # the newest: each draft saved the router as it was then, and the router only grows
            self.router.load(max(recs, key=lambda r: r["router"].get("docs", 0))["router"])
        return steps


def open_drafts(directory: str, cfg, params, *, draft_layers: int = 8, draft_model=None, tags: Sequence[str] = (),
                clusters: int = 0):
    """The router and the drafts of an online-distillation directory: one draft in ``directory``
    itself (no tags, no clusters: a router that sends everything to it), one per tag in
    ``directory/<tag>`` (``TagRouter``), or ``clusters`` drafts in ``directory/cluster<i>``
    (``CentroidRouter``, trained by the ``tags`` it is given). Returns (router, [(directory,
    TrainableDraft, DistillCheckpoints)]), each draft as distill.checkpoint.open_draft opens it."""
    import os

    from specjax.distill.checkpoint import open_draft

    require(clusters >= 0 and (not clusters or len(tags) <= clusters),
            f"{clusters} clusters cannot hold {len(tags)} tags")
    if clusters:
        router, dirs = CentroidRouter(clusters, tags=tags), [f"cluster{i}" for i in range(clusters)]
    elif tags:
        router, dirs = TagRouter(tags), list(tags)
    else:
        router, dirs = TagRouter(["*"]), [""]
    out = []
    for d in dirs:
        where = os.path.join(directory, d) if d else directory
        out.append((where, *open_draft(where, cfg, params, draft_layers, draft_model=draft_model)))
    return router, out
