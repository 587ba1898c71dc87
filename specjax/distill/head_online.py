"""Feature heads (drafters.eagle, drafters.medusa) trained by kind, offline and while serving.

``HeadTrainer``: a head's training as its kind (``drafters.heads.HeadKind``) defines it (the
target features its data keeps, its jitted optimizer step on an ``eagle_train.make_batch``
batch); ``distill.heads_offline`` trains with it before serving.

``HeadRefiner``: online refinement (seed 003's loop for a head). Hooked into
``ServingEngine(on_finish=...)``; every ``every`` finished requests it makes the head's training
data from them (one teacher-forced target forward per request: the serving steps keep the
target's features on the device only, so they are computed again, at prefill speed), keeps the
newest ``buffer`` sequences, takes ``steps`` optimizer steps and swaps the head's new params into
the backend (same shapes: nothing recompiles); the policy forgets the old head's acceptance. An
update with a non-finite loss or gradient is dropped and counted; the serving head stays as it
was.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax.distill import eagle_train as et
from specjax.distill import train as tr
from specjax.distill.online import OnlineConfig
from specjax.drafters import heads
from specjax.errors import require

log = logging.getLogger("specjax.distill")


@dataclasses.dataclass(frozen=True)
class HeadTrainer:
    """Training of one head (``draft``: a feature head's draft, whose ``head_kind`` says how it
    trains) with ``tc`` and ``optimizer``; ``unroll``: training-time-test steps, for a kind whose
    step ``unrolls``."""

    draft: object
    tc: tr.TrainConfig
    optimizer: object
    unroll: int = 3

    @property
    def kind(self) -> heads.HeadKind:
        return self.draft.head_kind

    @property
    def features(self) -> tuple[int, ...]:
        """The target features its data keeps (make_sequences' ``features``): the head's own."""
        return tuple(self.draft.features)

    def step(self, trainable, opt_state, frozen, batch):
        """One optimizer step on a make_batch batch: (trainable, opt_state, loss, ok)."""
        return self.kind.resolve("train_step")(trainable, opt_state, frozen, batch, draft=self.draft, tc=self.tc,
                                               optimizer=self.optimizer, unroll=self.unroll)


class HeadRefiner:
    """Refines the head the backend serves (``backend.drafter``: a feature head) on the requests
    it finishes. ``cfg``, ``params``: the target (for the teacher-forced forward)."""

    def __init__(self, backend, policy, cfg, params, tc: tr.TrainConfig, oc: OnlineConfig = OnlineConfig(),
                 buffer: int = 256, topk: int = 8, unroll: int = 3, prompt_loss: bool = False):
        drafter = backend.drafter
        require(drafter.draft is not None and drafter.draft.features, "online head refinement needs a feature head "
                "(--drafter eagle or medusa)")
        self.backend, self.policy, self.cfg, self.params, self.oc = backend, policy, cfg, params, oc
        self.topk, self.prompt_loss = topk, prompt_loss
        self.draft = drafter.draft
        self.trainer = HeadTrainer(self.draft, tc, tr.make_optimizer(tc), unroll)
        own = heads.trainable_of(self.draft, drafter.params)
        # (copies made for serving are made again from the trained arrays: serving_params)
        self.rows_copies = any(k.endswith(heads.SERVING_COPIES) for k in drafter.params)
        self.frozen = {k: v for k, v in drafter.params.items() if k not in own and not k.endswith(heads.SERVING_COPIES)}
        self.dtype = jax.tree_util.tree_leaves(own)[0].dtype  # (the serving dtype; trained in float32)
        self.trainable = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), own)
        self.opt_state = self.trainer.optimizer.init(self.trainable)
        self.seqs: collections.deque = collections.deque(maxlen=buffer)
        self.rng = np.random.default_rng(oc.seed)
        self.prompts: dict = {}
        self.pending: list = []  # (prompt, output) of requests finished since the last update
        self.finished = self.updates = self.dropped = 0
        self.update_s = 0.0
        self.losses: list[float] = []

    def expect(self, requests) -> None:
        """Remember the prompts of requests about to be served (a RequestOutput has none)."""
        self.prompts.update({r.id: list(r.prompt) for r in requests})

    # serve_job's hooks for a draft trained while serving (engine.loop.DraftGroups: one head, live)
    def group(self, req) -> int:
        return 0

    def activate(self, group):
        return self.policy

    def on_step(self, engine) -> None:
        pass

    def on_finish(self, out) -> None:
        prompt = self.prompts.pop(out.id, None)
        if prompt is not None and out.error is None and out.tokens:
            self.pending.append((prompt, list(out.tokens)))
        self.finished += 1
        if self.finished % self.oc.every == 0 and self.pending:
            self.update()

    def update(self) -> bool:
        """The pending requests' data joins the buffer, ``steps`` optimizer steps, the swap;
        False when a step was dropped (nothing of this update is swapped in)."""
        t0 = time.perf_counter()
        ps, outs = zip(*self.pending)
        self.pending = []
        self.seqs.extend(et.make_sequences(self.cfg, self.params, ps, outs, topk=self.topk,
                                           features=self.trainer.features))
        seqs = list(self.seqs)

        def step(trainable, state):
            batch = et.make_batch(seqs, self.rng, self.oc.batch, self.oc.length, prompt_loss=self.prompt_loss)
            return self.trainer.step(trainable, state, self.frozen, batch)

        got = tr.update_or_none(step, self.trainable, self.opt_state, self.oc.steps)
        if got[0] is None:
            self.dropped += 1
            log.warning("online head refinement: update %d dropped (loss %s is not finite or a gradient is not); "
                        "the serving head is unchanged", self.updates + 1, got[1])
            self.update_s += time.perf_counter() - t0
            return False
        self.trainable, self.opt_state, losses = got
        self.backend.swap_draft_params(self.serving_params())
        self.policy.draft_changed()
        self.updates += 1
        self.losses.append(float(np.mean(losses)))
        self.update_s += time.perf_counter() - t0
        return True

    def save(self, directory: str) -> None:
        """The refined head, as its kind's ``--<kind>_head`` serves it (heads.save_head)."""
        heads.save_head(self.trainer.kind, directory, self.cfg, self.serving_params(), self.draft, dtype=self.dtype)

    def serving_params(self) -> dict:
        """The head's params as the backend runs them (its serving dtype, the target's arrays)."""
        own = jax.tree_util.tree_map(lambda a: jnp.asarray(a, self.dtype), self.trainable)
        if self.rows_copies:  # (the copies serving made, of the new weights: HeadKind.serving_copies)
            return self.trainer.kind.serving_copies({**self.frozen, **own}, self.draft.fwd.rows_activations)
        return {**self.frozen, **own}
