"""``CompileKey``: the one static description of a compiled prefill or speculative step.

Everything that changes the code XLA compiles is a field here, and the jitted step functions
take it as their only static argument, so an executable is identified by one hashable value:
the model config, the operation (for a prefill run layer by layer, which of its programs) and
its shapes (batch bucket, cache slots, drafts per row or tree nodes, prompt bucket), the verify
rule (greedy-only or mixed sampling), the device drafter (None for host drafts, or a prefill
without the draft) and the forward options (attention implementation, prefix chunk, CPU
projection mode), the target features a feature head reads, and, for a sharded engine, the
``Layout`` (mesh and rules) its inputs and its returned state are placed by.
"""

from __future__ import annotations

import dataclasses

from specjax.config import ModelConfig
from specjax.drafters.device import ModelDraft
from specjax.models.options import ForwardOptions
from specjax.sharding import Layout


@dataclasses.dataclass(frozen=True)
class CompileKey:
    # "prefill" (a prompt's first chunk, into fresh caches) | "chunk" (a later prefill chunk) |
    # "step" (a chain of k drafts) | "tree" (a token tree of k draft nodes) |
    # "draft" (a device drafter's confidence-cut proposal of up to k drafts, Algorithm 3) |
    # "verify" (a chain step over k of the ``width`` drafts a "draft" call left on the device) |
    # "decode" (up to ``steps`` "step"s of k drafts in an on-device loop; k = 0: plain decoding)
    op: str
    cfg: ModelConfig
    batch: int
    slots: int
    greedy_only: bool
    draft: ModelDraft | None = None
    fwd: ForwardOptions = ForwardOptions()
    k: int = 0  # drafts per row (step) or draft nodes (tree); 0 = plain decoding
    prompt: int = 0  # prefill chunk size (prefill / chunk)
    width: int = 0  # verify: drafts per row the draft call produced (its k)
    tokens: int = 0  # step / tree / verify: the block's real tokens packed into this many rows (0: not packed)
    teacher: int = 0  # step / verify: also return the target's top-k logits at the verified positions (k; 0: none)
    layout: Layout | None = None  # sharded engine: the mesh and rules (None: one device)
    steps: int = 0  # decode: the most steps one call runs (its token buffer's width)
    # the target layers whose inputs the target forward also returns (a feature head's signal,
    # drafters.eagle: the draft consumes them inside the executable); () = none, the program
    # is then exactly the one without feature heads
    features: tuple[int, ...] = ()
    # one program of a layered prefill (prefill / chunk as 2 + L calls, step.prefill_embed ...):
    # "embed", "finish", or "layer" + the index of the first layer of its params' shapes; "": the whole
    part: str = ""

    def __post_init__(self):
        if self.op not in ("prefill", "chunk", "step", "tree", "draft", "verify", "decode"):
            raise ValueError(f"unknown compiled operation {self.op!r}")

    def describe(self) -> str:
        what = {"prefill": f"prefill of a {self.prompt}-token first chunk",
                "chunk": f"prefill of a {self.prompt}-token later chunk", "step": f"spec step with K {self.k}",
                "tree": f"tree step with {self.k} draft nodes", "draft": f"draft call of up to {self.k} drafts",
                "verify": f"verify step with K {self.k} of {self.width} device drafts",
                "decode": f"decode call of up to {self.steps} steps" + (f" with K {self.k}" if self.k else "")}[self.op]
        packed = f", {self.tokens} packed tokens" if self.tokens else ""
        teacher = f", teacher top-{self.teacher}" if self.teacher else ""
        feats = f", target features of layers {list(self.features)}" if self.features else ""
        part = f" ({self.part} program of a layered prefill)" if self.part else ""
        return f"{what} for batch {self.batch}, slots {self.slots}{packed}{teacher}{feats}{part}"
