"""What the feature heads (drafters.eagle, drafters.medusa) share: a reduced vocabulary whose rows
may be the target's own, the split between the head's own arrays and the target's shared ones,
and saving / loading a head beside the name of its target.

A head kind (``HeadKind``) names its file (``<name>.json``: target, vocabulary size, the feature
layers it reads, its vocabulary ids, whether those rows are the target's, its own settings) and
knows how to make its draft from those settings; the arrays are an orbax checkpoint recorded like
a distilled draft's (``distill.checkpoint``). The target's ``embed`` and ``final_norm`` (and, with
``shared_head``, its rows for the vocabulary ids) are never copied into a head or saved with it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax import ondisk
from specjax.config import ModelConfig
from specjax.device_arrays import to_device
from specjax.drafters.table import resolve
from specjax.errors import SpecjaxError, require
from specjax.models import llama, prepared

SHARED = ("embed", "final_norm")  # the target's arrays a head runs with

# Heads shipped in the repository (heads/), by kind and target: what ``--drafter eagle`` /
# ``--drafter medusa`` run when no head directory is given.
HEADS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "heads")
SHIPPED = {("eagle", "smollm2-135m"): "smollm2-135m-instruct-eagle",
           ("medusa", "smollm2-135m"): "smollm2-135m-instruct-medusa"}


@dataclasses.dataclass(frozen=True)
class HeadKind:
    """One kind of feature head. ``init(cfg, params, vocab_ids, seed=, shared_head=, **settings)``
    -> (draft, params); ``draft_of(cfg, ids, shared_head, **settings)`` -> the draft;
    ``settings``: the draft's own fields its file records too (Medusa: how many heads).

    What training needs of a kind (distill.head_online, distill.heads_offline ask these, never its
    name). The trainers import this package, so their functions are ``"module:function"`` paths,
    resolved on use. ``train_step``: one optimizer step on an ``eagle_train.make_batch`` batch,
    ``(trainable, opt_state, frozen, batch, *, draft, tc, optimizer, unroll)`` -> (trainable,
    opt_state, loss, ok). ``unrolls``: that step also trains on the head's own predicted features
    (``unroll`` steps: part of what a run's checkpoints must match). ``options``: (setting, warm-up
    option) pairs a new head's settings are taken from. ``after_round``: ``(draft, params,
    held-out sequences) -> (draft, report line)``, run after each warm-up round on the held-out
    text's features. ``check(k, settings)``: a one-line SpecjaxError where heads of these settings
    cannot draft K = ``k``. ``chain_hits``: ``(params, batch, *, draft, k)`` -> (hits, valid)
    [B, T, k] bools, whether draft j of the greedy chain whose pending token is at window entry p
    is the target's top-1 (the held-out acceptance estimate of distill.head_pipeline).
    ``attends``: the head's layer attends over earlier positions, so a training window that
    starts inside a sequence carries context positions before its trained ones.
    ``serving_copies``: ``(params, activations) -> params`` with the copies serving makes of the
    head's arrays for a rows kernel multiplying ``activations`` (its draft's ``fwd``; keys ending in
    ``SERVING_COPIES``; eagle: Q8_0 copies for the rows kernel), made again from
    trained arrays by distill.head_online. ``grow``: ``(new trainable, saved trainable) -> new
    trainable``, a trained head's arrays in a head of larger settings computing the same function
    (``--init_head`` with other settings; eagle: a wider MLP). A file written before a setting
    existed takes the draft's default for it (``settings_of``)."""

    name: str
    title: str
    init: Callable
    draft_of: Callable
    settings: tuple[str, ...] = ()
    train_step: str | None = None
    unrolls: bool = False
    options: tuple[tuple[str, str], ...] = ()
    after_round: str | None = None
    check: Callable | None = None
    chain_hits: str | None = None
    attends: bool = False
    serving_copies: Callable | None = None
    grow: Callable | None = None

    @property
    def file(self) -> str:
        return f"{self.name}.json"

    def features(self, cfg: ModelConfig, **settings) -> tuple[int, ...]:
        """The target features a head reads: what its training data keeps of the target."""
        return tuple(self.draft_of(cfg, np.arange(1), False, **settings).features)

    def resolve(self, what: str) -> Callable | None:
        """The function a ``"module:function"`` field (``train_step``, ``after_round``,
        ``chain_hits``) names."""
        return resolve(getattr(self, what))


def settings_of(kind: HeadKind, spec: dict, cfg: ModelConfig, names: tuple[str, ...] | None = None) -> dict:
    """A head file's (or a run's) settings ``names`` (default: all the kind's): those it records;
    one written before a setting existed is a head of that setting's default (the draft's)."""
    names = kind.settings if names is None else names
    draft = kind.draft_of(cfg, np.arange(1), False, **{k: spec[k] for k in kind.settings if k in spec})
    return {k: getattr(draft, k) for k in names}


def check_ids(vocab_ids, V: int) -> np.ndarray:
    """A reduced vocabulary as int32 ids, or a one-line SpecjaxError."""
    ids = np.asarray(vocab_ids)
    require(ids.ndim == 1 and ids.size >= 1 and np.issubdtype(ids.dtype, np.integer),
            f"a reduced vocabulary is a 1-D list of token ids, got shape {ids.shape} of {ids.dtype}")
    require(ids.min() >= 0 and ids.max() < V and len(np.unique(ids)) == ids.size,
            f"reduced vocabulary ids must be distinct ids of the target's {V} tokens")
    return ids.astype(np.int32)


def target_rows(cfg: ModelConfig, params, ids) -> jax.Array:
    """The target's vocab-head rows for ``ids`` as a [D, N] head."""
    try:  # (on the host: eager jax ops compiled a transpose and a gather of the whole vocab head,
        # half a second of a first answer)
        rows = np.asarray(params["embed"])[ids] if cfg.tie_embeddings else np.asarray(params["lm_head"])[:, ids].T
        return to_device(np.ascontiguousarray(rows.T))
    except jax.errors.TracerArrayConversionError:  # traced (eval_shape, training)
        head = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
        return jnp.take(head, jnp.asarray(ids), axis=1)


def with_target(draft, trainable, vocab_ids, cfg: ModelConfig, params) -> dict:
    """The head's params as the step runs them: its own arrays plus the target's shared ones
    (with a shared head, the target's vocab rows for ``vocab_ids``: built here, never saved)."""
    out = {**trainable, "vocab_ids": jnp.asarray(vocab_ids, jnp.int32), **{k: params[k] for k in SHARED}}
    if draft.shared_head:
        out["lm_head"] = target_rows(cfg, params, vocab_ids)
    return out


SERVING_COPIES = llama.ROWS_SUFFIX  # keys of the copies serving makes of a head (eagle.for_rows_kernel)


def trainable_of(draft, dparams) -> dict:
    """The head's own arrays (what is trained and saved): not the target's, not the id map, not
    the copies serving makes of them (``SERVING_COPIES``)."""
    shared = SHARED + (("lm_head",) if draft.shared_head else ())
    return {k: v for k, v in dparams.items()
            if k not in shared and k != "vocab_ids" and not k.endswith(SERVING_COPIES)}


def _checkpoints(directory: str, cfg: ModelConfig, draft, trainable, ids):
    from specjax.distill.checkpoint import DistillCheckpoints, fingerprint

    return DistillCheckpoints(directory, fingerprint(cfg, draft.cfg, trainable, ids), max_to_keep=1)


def save_head(kind: HeadKind, directory: str, cfg: ModelConfig, dparams, draft, dtype=None,
              training: dict | None = None) -> None:
    """Write the head (its own arrays, orbax; cast to ``dtype`` if given: bfloat16 halves the
    file) and its ``kind.file`` to ``directory``; ``training``: how it was trained so far (the
    training tokens it has seen, held-out measurements), recorded in that file, so the heads a
    run saves along the way are the points of its curve."""
    ids = np.asarray(dparams["vocab_ids"], np.int32)
    trainable = trainable_of(draft, dparams)
    if dtype is not None:
        trainable = jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype), trainable)
    spec = {"target": cfg.name, "vocab_size": cfg.vocab_size, "features": list(draft.features),
            "shared_head": draft.shared_head, "dtype": str(jax.tree_util.tree_leaves(trainable)[0].dtype),
            **{k: getattr(draft, k) for k in kind.settings}, **({"training": training} if training else {}),
            "vocab_ids": ids.tolist()}
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise SpecjaxError(f"cannot write an {kind.title} head to {directory}: {e}".splitlines()[0]) from None
    if not ondisk.write(os.path.join(directory, kind.file), json.dumps(spec).encode()):
        raise SpecjaxError(f"cannot write an {kind.title} head to {directory}")
    _checkpoints(directory, cfg, draft, trainable, ids).save_next(trainable, {}, {"kind": kind.name})


def read_spec(kind: HeadKind, directory: str, cfg: ModelConfig) -> dict:
    """The ``kind.file`` of the head in ``directory``, checked to be of this target (else a
    one-line SpecjaxError)."""
    blob = ondisk.read(os.path.join(directory, kind.file))
    if blob is None:
        raise SpecjaxError(f"{directory} holds no {kind.title} head ({kind.file} is missing or damaged)")
    try:
        spec = json.loads(blob)
        target, V, layers = spec["target"], spec["vocab_size"], tuple(spec["features"])
        spec["vocab_ids"] = np.asarray(spec["vocab_ids"])
        settings = settings_of(kind, spec, cfg)
        spec.update(settings)
    except (ValueError, KeyError, TypeError) as e:
        raise SpecjaxError(f"{directory}/{kind.file} cannot be read: {type(e).__name__}: {e}".splitlines()[0][:300]) \
            from None
    if target != cfg.name or V != cfg.vocab_size or layers != kind.features(cfg, **settings):
        raise SpecjaxError(f"{directory} holds an {kind.title} head of {target} ({V} tokens, features of layers "
                           f"{list(layers)}), not of {cfg.name}")
    spec["vocab_ids"] = check_ids(spec["vocab_ids"], cfg.vocab_size)
    return spec


def load_head(kind: HeadKind, directory: str, cfg: ModelConfig, params):
    """(draft, params) of the head saved in ``directory`` for this target, in the target's dtype;
    a directory without one, or a head of another target: a one-line SpecjaxError."""
    spec = read_spec(kind, directory, cfg)
    ids, settings = spec["vocab_ids"], settings_of(kind, spec, cfg)
    shared_head = bool(spec.get("shared_head", False))
    draft = kind.draft_of(cfg, ids, shared_head, **settings)
    dtype = params["embed"].dtype

    def restore():
        # The structure to restore into, as numpy zeros of a traced init's shapes (eager jax ops
        # here compiled a program per array: a second of a first answer).
        shapes = jax.eval_shape(lambda p: trainable_of(draft, kind.init(cfg, p, ids, shared_head=shared_head,
                                                                        **settings)[1]), params)
        saved = jax.tree_util.tree_map(lambda a: np.zeros(a.shape, jnp.dtype(spec.get("dtype", a.dtype))), shapes)
        got = _checkpoints(directory, cfg, draft, saved, ids).restore(saved, {})
        if got is None:
            raise SpecjaxError(f"{directory} holds no intact {kind.title} head checkpoint")
        return jax.tree_util.tree_map(lambda a: to_device(np.asarray(a), dtype), got[1])

    # Restored once, then mapped back (models.prepared).
    label = "eagle head" if kind.name == "eagle" else f"{kind.name} head"
    store = prepared.Store.for_directory(directory, f"{label}\n{cfg.name}\n{jnp.dtype(dtype).name}")
    head = store.cached("head", restore) if store else restore()
    return draft, with_target(draft, head, ids, cfg, params)


def shipped_head(kind: HeadKind, cfg: ModelConfig) -> str | None:
    """The directory of the head of this kind shipped for this target, if there is one."""
    name = SHIPPED.get((kind.name, cfg.name))
    path = name and os.path.join(HEADS_DIR, name)
    return path if path and os.path.exists(os.path.join(path, kind.file)) else None
