"""The draft-model kinds of the drafter table: ``layer_skip`` (the target's first layers) and
``draft_model`` (an independent model sharing the target's tokenizer), each as it is or as a
distilled draft's checkpoint (distill.checkpoint)."""

from __future__ import annotations

import jax.numpy as jnp

from specjax.drafters.device import DeviceDrafter, ModelDraft, layer_skip
from specjax.errors import require
from specjax.models.options import ForwardOptions


def draft_forward(fwd: ForwardOptions | None) -> ForwardOptions:
    """The forward a draft model runs (ModelDraft.fwd) in an engine running ``fwd``: the engine's
    when it runs the rows kernel (the draft then reads the quantized packs, a fraction of the
    float32 bytes, as the target's steps do), else the plain one."""
    return fwd if fwd is not None and fwd.rows_kernel else ForwardOptions()


def build_layer_skip(model, spec, draft=None) -> DeviceDrafter:
    """The ``layer_skip`` kind: the target's first ``draft_layers`` layers (or a distilled
    self-draft's checkpoint, whose draft.json says how many)."""
    cfg = model.cfg
    if spec.draft_checkpoint:
        from specjax.distill.checkpoint import load_draft

        td, trainable = load_draft(spec.draft_checkpoint, cfg, model.params)
        return DeviceDrafter(td.draft, td.params(trainable))
    require(1 <= spec.draft_layers <= cfg.num_layers - 1, f"--draft_layers must be in 1..{cfg.num_layers - 1} for "
            f"{cfg.name} ({cfg.num_layers} layers), got {spec.draft_layers}")
    fwd = draft_forward(spec.fwd)
    return DeviceDrafter(*layer_skip(cfg, model.params_for(fwd), spec.draft_layers, fwd))


def build_draft_model(model, spec, draft=None) -> DeviceDrafter:
    """The ``draft_model`` kind: an independent draft model sharing the target's tokenizer
    (``draft``: already loaded, else ``spec.draft_model`` is loaded in the target's dtype), or a
    distilled one's checkpoint."""
    cfg = model.cfg
    if draft is None:
        from specjax.models.loader import load_model

        require(bool(spec.draft_model), "--drafter draft_model needs --draft_model (a model name, .gguf file or HF dir)")
        draft = load_model(spec.draft_model, str(jnp.dtype(model.params["embed"].dtype)))
    require(draft.cfg.vocab_size == cfg.vocab_size,
            f"draft model {draft.cfg.name} has vocabulary size {draft.cfg.vocab_size} but the target {cfg.name} has "
            f"{cfg.vocab_size}; draft and target must share a tokenizer")
    if spec.draft_checkpoint:
        from specjax.distill.checkpoint import load_draft

        td, trainable = load_draft(spec.draft_checkpoint, cfg, model.params, draft_model=draft)
        return DeviceDrafter(td.draft, td.params(trainable))
    # (the kernel where the draft's own file keeps quantized blocks: packing float32 weights
    # would copy them, LoadedModel.auto_rows_kernel)
    fwd = draft_forward(spec.fwd) if draft.auto_rows_kernel() else ForwardOptions()
    return DeviceDrafter(ModelDraft(draft.cfg, fwd=fwd), draft.params_for(fwd))
