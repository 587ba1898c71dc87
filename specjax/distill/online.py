"""Online speculative decoding (seed 003, Algorithm 1): the draft learns from the verifier's own
signals while the engine serves.

Hooked into ``ServingEngine(on_finish=...)``, so everything here runs between engine steps.
Each finished request's teacher rows (the target's top-k at every verified position, kept by
the step: ``JaxBackend(teacher_topk=k)``) become a ``Record`` in the replay buffer. Every
``every`` finished requests, ``steps`` optimizer steps train the self-draft on batches from the
buffer; the new params then swap into the backend at once (same shapes: nothing recompiles) and
the policy forgets the old draft's acceptance. An update whose loss or gradient is not finite is
dropped and counted (``dropped``; logged), and the serving params stay as they were: a draft is
never half swapped. With ``idle_rows``, an update also runs opportunistically between steps
(``on_step``, the ServingEngine hook) when the engine is lightly loaded: at most that many rows
running and no request waiting for one, the load under which SmartSpec's goodput choice still
leaves spare compute, with at least ``idle_min_new`` new records since the last update.
With ``checkpoints`` (checkpoint.DistillCheckpoints), every
``checkpoint_every`` updates are saved; ``resume`` continues from the latest.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Sequence

import numpy as np

from specjax.distill import train as tr
from specjax.distill.buffer import Record, ReplayBuffer
from specjax.distill.divergences import TopK
from specjax.errors import require

log = logging.getLogger("specjax.distill")


@dataclasses.dataclass(frozen=True)
class OnlineConfig:
    """every: finished requests between updates (the seed's I); steps: optimizer steps per
    update; batch: records per step; length: tokens per record in a batch (its last ones);
    buffer_rows: the replay buffer's budget of teacher rows; checkpoint_every: updates between
    checkpoints (0: none); idle_rows: also update between steps while at most this many rows run
    and none wait (0: never), once ``idle_min_new`` new records are in."""

    every: int = 8
    steps: int = 4
    batch: int = 8
    length: int = 128
    buffer_rows: int = 65536
    checkpoint_every: int = 0
    idle_rows: int = 0
    idle_min_new: int = 4
    seed: int = 0

    def __post_init__(self):
        for f in ("every", "steps", "batch", "length", "buffer_rows"):
            require(getattr(self, f) >= 1, f"OnlineConfig.{f} must be >= 1, got {getattr(self, f)}")
        for f in ("checkpoint_every", "idle_rows"):
            require(getattr(self, f) >= 0, f"OnlineConfig.{f} must be >= 0, got {getattr(self, f)}")
        require(self.idle_min_new >= 1, f"OnlineConfig.idle_min_new must be >= 1, got {self.idle_min_new}")


class OnlineDistiller:
    def __init__(self, backend, policy, draft: tr.TrainableDraft, tc: tr.TrainConfig, oc: OnlineConfig = OnlineConfig(),
                 checkpoints=None):
        require(backend.device_draft, "online distillation trains a device draft; this backend has none")
        require(backend.table.teacher_topk > 0, "online distillation needs the step's teacher signal: build the "
                "backend with teacher_topk > 0")
        self.backend, self.policy, self.draft, self.tc, self.oc = backend, policy, draft, tc, oc
        self.optimizer = tr.make_optimizer(tc)
        self.trainable = draft.trainable
        self.opt_state = self.optimizer.init(self.trainable)
        self.buffer = ReplayBuffer(oc.buffer_rows)
        self.checkpoints = checkpoints
        self.rng = np.random.default_rng(oc.seed)
        self.prompts: dict = {}
        self.finished = self.updates = self.dropped = 0
        self.new = 0  # records since the last update
        self.saved_updates = 0  # self.updates at the latest checkpoint
        self.serving = True  # this draft is the backend's live one (routing.MultiDraft switches it)
        self.extra_record = None  # () -> dict saved with every checkpoint (say a router's state)
        self.resumed_record: dict | None = None
        self.idle_updates = 0  # updates run opportunistically (on_step), of self.updates
        self.update_s = 0.0
        self.losses: list[float] = []  # the mean loss of each applied update

    def expect(self, requests: Sequence) -> None:
        """Remember the prompts of requests about to be served (a RequestOutput has none)."""
        self.prompts.update({r.id: list(r.prompt) for r in requests})

    def on_finish(self, out) -> None:
        prompt = self.prompts.pop(out.id, None)
        rec = Record.of(prompt, out) if prompt is not None and out.error is None else None
        if rec is not None:
            self.buffer.add(rec)
            self.new += 1
        self.finished += 1
        if self.checkpoints is not None:
            self.checkpoints.poll()  # (a checkpoint written in the background counts once recorded)
        if self.finished % self.oc.every == 0 and len(self.buffer):
            self.update()

    def on_step(self, engine) -> None:
        """ServingEngine(on_step=...): an opportunistic update while the load is light."""
        if not self.oc.idle_rows or self.new < self.oc.idle_min_new:
            return
        running, waiting = engine.load()
        if running <= self.oc.idle_rows and not waiting and self.update():
            self.idle_updates += 1

    def update(self) -> bool:
        """``steps`` optimizer steps, then the swap; False when any step was dropped (nothing of
        this update is then swapped in)."""
        t0 = time.perf_counter()

        def step(trainable, state):
            tokens, ids, logits, mask = self.buffer.batch(self.rng, self.oc.batch, self.oc.length)
            return tr.train_step(trainable, state, self.draft.frozen, tokens, TopK(ids, logits), mask,
                                 cfg=self.draft.draft.cfg, tc=self.tc, optimizer=self.optimizer)

        got = tr.update_or_none(step, self.trainable, self.opt_state, self.oc.steps)
        if got[0] is None:
            self.dropped += 1
            log.warning("online distillation: update %d dropped (loss %s is not finite or a gradient is not); "
                        "the serving draft is unchanged", self.updates + 1, got[1])
            self.update_s += time.perf_counter() - t0
            return False
        trainable, state, losses = got
        self.trainable, self.opt_state = trainable, state
        self.new = 0
        if self.serving:  # (a draft not being served now swaps in when it is activated)
            self.backend.swap_draft_params(self.draft.params(trainable))
        self.policy.draft_changed()
        self.updates += 1
        self.losses.append(float(np.mean(losses)))
        if self.oc.checkpoint_every and self.updates % self.oc.checkpoint_every == 0:
            self.save(wait=False)  # written while serving goes on
        self.update_s += time.perf_counter() - t0
        return True

    def save(self, wait: bool = True) -> int | None:
        """Checkpoint the current draft as the next step unless no update came since the last
        save (``wait``: until it is on disk; else it is written in the background); the latest
        recorded step (the one a restart restores: a step a kill tore is not it), or None without
        checkpoints or anything saved."""
        if self.checkpoints is None:
            return None
        if self.updates != self.saved_updates:
            self.checkpoints.save_next(self.trainable, self.opt_state, self.record(), wait=wait)
            self.saved_updates = self.updates
        if wait:
            self.checkpoints.wait()
        return self.checkpoints.latest_recorded() if wait else self.checkpoints.latest_step()

    def record(self) -> dict:
        """What a checkpoint keeps besides the params and the optimizer state."""
        rec = {"finished": self.finished, "updates": self.updates, "dropped": self.dropped,
               "idle_updates": self.idle_updates, "buffer": self.buffer.metadata()}
        return rec | (self.extra_record() if self.extra_record else {})

    def resume(self) -> int | None:
        """Continue from the latest checkpoint, if any (its params are swapped in): its step, or None."""
        if self.checkpoints is None:
            return None
        got = self.checkpoints.restore(self.trainable, self.opt_state)
        if got is None:
            return None
        step, self.trainable, self.opt_state, rec = got
        self.finished, self.updates, self.dropped = rec["finished"], rec["updates"], rec["dropped"]
        self.idle_updates = rec.get("idle_updates", 0)
        self.saved_updates = self.updates
        self.resumed_record = rec
        if self.serving:
            self.backend.swap_draft_params(self.draft.params(self.trainable))
        self.policy.draft_changed()
        return step


def acceptance_curve(outs: Sequence, window: int = 50) -> np.ndarray:
    """The moving acceptance rate (accepted / drafted) over the last ``window`` requests, in
    the order given: the seed's figure of the draft learning while it serves."""
    acc = np.array([o.accepted for o in outs], float)
    dr = np.array([o.drafted for o in outs], float)
    ca, cd = np.concatenate([[0], np.cumsum(acc)]), np.concatenate([[0], np.cumsum(dr)])
    i = np.arange(1, len(outs) + 1)
    lo = np.maximum(0, i - window)
    return (ca[i] - ca[lo]) / np.maximum(cd[i] - cd[lo], 1.0)
