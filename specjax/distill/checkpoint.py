"""orbax checkpoints of a draft being distilled: its trainable params, the optimizer state and a
JSON record (the step, the replay buffer's and router's metadata, whatever the loop needs to go
on), every few updates, the last few kept.

A checkpoint directory also holds ``draft.json``: which draft it trains (the target, a
self-draft's layer count or the draft model's name, a reduced head's token ids), written once
when the directory is first used, so a later run (a resumed job, the batch job after
``launch/distill.py``) builds the same draft to restore into (``open_draft``).

Each checkpoint carries a fingerprint of the draft it belongs to (the target's and the draft's
config and every trainable leaf's shape and dtype). Restoring a checkpoint of another model, or
one that cannot be read, is a one-line SpecjaxError that changes nothing: the caller's params
stay as they were.

Once orbax has finished a step, every file of it is recorded (size and hash, specjax.ondisk:
``<step>.sha256`` beside the step's directory), and so is ``draft.json``. A step that does not
match its record (damaged, or cut off before it was recorded) is never restored: ``restore``
logs it once and takes the newest step that matches, or none (a fresh start). A ``draft.json``
that does not match is logged once and written again for the draft being opened (a checkpoint
of another draft is then still refused by its fingerprint).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import numpy as np
import orbax.checkpoint as ocp

from specjax import ondisk
from specjax.config import ModelConfig
from specjax.device_arrays import param_avals
from specjax.errors import SpecjaxError

log = logging.getLogger(__name__)


def fingerprint(target: ModelConfig, draft: ModelConfig, trainable, vocab_ids=None) -> dict:
    """What a checkpoint must match to be restored into this draft (``vocab_ids``: a reduced
    head's target tokens, which the params are only meaningful with)."""
    shapes = json.dumps(param_avals(trainable), sort_keys=True, default=str)
    fp = {"target": target.name, "target_layers": target.num_layers, "vocab_size": target.vocab_size,
          "draft": draft.name, "draft_layers": draft.num_layers,
          "trainable": hashlib.sha256(shapes.encode()).hexdigest()[:16]}
    if vocab_ids is not None:
        fp["vocab_ids"] = hashlib.sha256(np.asarray(vocab_ids, np.int32).tobytes()).hexdigest()[:16]
    return fp


DRAFT_FILE = "draft.json"


def open_draft(directory: str, cfg: ModelConfig, params, draft_layers: int = 8, vocab_ids=None, draft_model=None,
               max_to_keep: int = 3):
    """(TrainableDraft, DistillCheckpoints) for the checkpoint directory ``directory``: the draft
    its ``draft.json`` names. A new directory gets that file, for a self-draft of
    ``draft_layers`` layers or, given ``draft_model`` (a loaded model sharing the target's
    tokenizer), that model; ``vocab_ids``: a reduced head. A directory of another target or
    draft, or a ``draft.json`` that cannot be read: a one-line SpecjaxError."""
    from specjax.distill.train import TrainableDraft
    from specjax.drafters.device import ModelDraft, check_pair

    path = os.path.join(directory, DRAFT_FILE)
    model_name = None if draft_model is None else draft_model.cfg.name
    blob = ondisk.read(path)  # None: no file, or one that is damaged (logged; written again below)
    if blob is not None:
        try:
            spec = json.loads(blob)
            target, draft_layers, vocab = spec["target"], spec["draft_layers"], spec["vocab_ids"]
            named = spec.get("draft_model")
        except (ValueError, KeyError, TypeError) as e:
            raise SpecjaxError(f"{path} cannot be read: {type(e).__name__}: {e}".splitlines()[0][:300]) from None
        if target != cfg.name or spec.get("vocab_size") != cfg.vocab_size:
            raise SpecjaxError(f"{directory} holds a draft of {target} ({spec.get('vocab_size')} tokens), not of "
                               f"{cfg.name} ({cfg.vocab_size} tokens)")
        if named != model_name:
            raise SpecjaxError(f"{directory} trains " + (f"the draft model {named}" if named else
                               f"a {draft_layers}-layer self-draft") + ", not " +
                               (f"the draft model {model_name}" if model_name else "a self-draft"))
        vocab_ids = None if vocab is None else np.asarray(vocab, np.int32)
    if draft_model is None:  # (checks the layers and the vocabulary map)
        td = TrainableDraft.of(cfg, params, int(draft_layers), vocab_ids)
    else:
        d = ModelDraft(draft_model.cfg)
        check_pair(cfg, d, draft_model.params)
        td = TrainableDraft.of_model(d, draft_model.params, vocab_ids)
    if blob is None:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise SpecjaxError(f"cannot use {directory} for checkpoints: {e}".splitlines()[0]) from None
        spec = {"target": cfg.name, "vocab_size": cfg.vocab_size,
                "draft_layers": None if draft_model is not None else draft_layers, "draft_model": model_name,
                "vocab_ids": None if vocab_ids is None else [int(t) for t in vocab_ids]}
        if not ondisk.write(path, json.dumps(spec).encode()):
            raise SpecjaxError(f"cannot use {directory} for checkpoints: {path} cannot be written")
    fp = fingerprint(cfg, td.draft.cfg, td.trainable, vocab_ids)
    return td, DistillCheckpoints(directory, fp, max_to_keep)


def load_draft(directory: str, cfg: ModelConfig, params, draft_model=None):
    """(TrainableDraft, trained params) of the latest checkpoint in ``directory``, to serve with;
    a directory without one, or of another model: a one-line SpecjaxError."""
    from specjax.distill.train import TrainConfig, make_optimizer

    if not os.path.exists(os.path.join(directory, DRAFT_FILE)):
        raise SpecjaxError(f"{directory} holds no distilled draft ({DRAFT_FILE} is missing)")
    td, ck = open_draft(directory, cfg, params, draft_model=draft_model)
    got = ck.restore(td.trainable, make_optimizer(TrainConfig()).init(td.trainable))  # (any schedule: same state)
    if got is None:
        raise SpecjaxError(f"{directory} holds no checkpoint of its draft yet")
    return td, got[1]


class DistillCheckpoints:
    """Checkpoints under ``directory`` for the draft with ``fp`` (``fingerprint``)."""

    def __init__(self, directory: str, fp: dict, max_to_keep: int = 3):
        self.directory = os.path.abspath(directory)
        self.fp = fp
        self._unrecorded: list[int] = []  # steps saved in the background, recorded once finished
        try:
            self.mgr = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, create=True))
        except (OSError, ValueError) as e:
            raise SpecjaxError(f"cannot use {self.directory} for checkpoints: {e}".splitlines()[0]) from None

    def latest_step(self) -> int | None:
        """The newest step orbax knows, recorded or not (a kill may have torn it): what the next
        save numbers after."""
        return self.mgr.latest_step()

    def latest_recorded(self) -> int | None:
        """The newest step with its record on disk: the one a restart restores (unless damaged
        since), and so the one to report as saved."""
        return max((s for s in self.mgr.all_steps() if os.path.exists(self._step_dir(s) + ondisk.RECORD)),
                   default=None)

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def _settle(self) -> None:
        """Wait for a save in progress, then record the steps finished since (their files'
        sizes and hashes), and drop the records of steps orbax has since removed."""
        self.mgr.wait_until_finished()
        for step in self._unrecorded:
            if os.path.isdir(self._step_dir(step)):
                ondisk.seal(self._step_dir(step))
        self._unrecorded.clear()
        for f in os.listdir(self.directory):
            if f.endswith(ondisk.RECORD) and not os.path.exists(os.path.join(self.directory, f[:-len(ondisk.RECORD)])):
                try:
                    os.unlink(os.path.join(self.directory, f))
                except OSError:
                    pass

    def poll(self) -> None:
        """Record a background save that has finished, without waiting for one that has not (the
        serving loop calls this as requests finish, so a kill finds the latest step recorded)."""
        if self._unrecorded and not self.mgr.is_saving_in_progress():
            self._settle()

    def save(self, step: int, trainable, opt_state, record: dict, wait: bool = True) -> None:
        """Write checkpoint ``step``; with ``wait``, return once it is on disk and recorded (a
        kill after that loses nothing up to ``step``), else while it is written in the background
        (serving goes on; it is recorded by the first ``poll``, save, ``wait`` or ``restore`` after
        it finished, and a kill before that leaves the previous checkpoint the one restored). A save or restore first
        waits for a save in progress."""
        self._settle()
        self.mgr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave({"trainable": trainable, "opt_state": opt_state}),
            record=ocp.args.JsonSave({"fingerprint": self.fp, **record})))
        self._unrecorded.append(step)
        if wait:
            self._settle()

    def save_next(self, trainable, opt_state, record: dict, wait: bool = True) -> int:
        """``save`` as the step after the latest (one in progress included); returns it."""
        self._settle()
        step = (self.latest_step() or 0) + 1
        self.save(step, trainable, opt_state, record, wait)
        return step

    def wait(self) -> None:
        self._settle()

    def restore(self, trainable, opt_state, step: int | None = None):
        """(step, trainable, opt_state, record) of checkpoint ``step`` (default: the newest that
        matches its record; a newer one that does not is logged once and passed over), with
        ``trainable`` / ``opt_state`` as the templates of its structure; None when there is no
        intact checkpoint. A checkpoint of another draft, or ``step`` damaged or unreadable:
        SpecjaxError."""
        self._settle()
        steps = sorted(self.mgr.all_steps(), reverse=True) if step is None else [step]
        for s in steps:
            if ondisk.verified(self._step_dir(s)):  # (a damaged one is logged there)
                return self._restore(s, trainable, opt_state)
            if step is not None:
                raise SpecjaxError(f"checkpoint {step} in {self.directory} cannot be read: it is damaged or incomplete")
        if steps:
            log.warning("no intact checkpoint in %s; starting from the initial draft", self.directory)
        return None

    def _restore(self, step: int, trainable, opt_state):
        where = f"checkpoint {step} in {self.directory}"
        try:
            record = self.mgr.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))["record"]
        except Exception as e:  # orbax raises many kinds for a file it cannot read
            raise SpecjaxError(f"{where} cannot be read: {type(e).__name__}: {e}".splitlines()[0][:300]) from None
        if not isinstance(record, dict) or record.get("fingerprint") != self.fp:
            got = record.get("fingerprint") if isinstance(record, dict) else record
            raise SpecjaxError(f"{where} belongs to another draft ({got}), not this one ({self.fp})")
        try:
            state = self.mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(
                {"trainable": trainable, "opt_state": opt_state})))["state"]
        except Exception as e:
            raise SpecjaxError(f"{where} cannot be read: {type(e).__name__}: {e}".splitlines()[0][:300]) from None
        check = param_avals(state["trainable"]) == param_avals(trainable)
        if not check:
            raise SpecjaxError(f"{where} does not hold this draft's shapes")
        record = {k: v for k, v in record.items() if k != "fingerprint"}
        return step, state["trainable"], state["opt_state"], record
