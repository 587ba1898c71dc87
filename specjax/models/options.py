"""``ForwardOptions``: every setting besides the model config and the shapes that changes the
compiled forward pass. It is a static argument of every jitted model function, so it is part of
each executable's compile key, and nothing that changes compiled code is a process-wide switch.
"""

from __future__ import annotations

import dataclasses

from specjax.errors import require

# Layers per loop iteration where the launch scripts run the layers as a loop (scan_layers -1 on
# the rows kernel with the CPU attention) and of the engine's stand-in steps: SmolLM2's decode
# forward as 6 iterations compiled in 1.3-1.4 s against the list's 5.5-6.6 s and ran within 0-11%
# of its steps; 1 per iteration compiled in 0.8 s and ran 30% slower (BENCHMARKS.md)
DEFAULT_SCAN_UNROLL = 5


ROWS_ACTIVATIONS = ("float32", "int8", "bfloat16")  # ForwardOptions.rows_activations, rows_dot's activations


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
    """attention: "xla" (plain XLA; the library default), "pallas" (the tree-attention kernel for
    blocks of up to 64 tokens: Triton on GPU, Mosaic on TPU, interpret mode on CPU) or "cpu"
    (decode and verify blocks through the CPU kernel rows_dot.block_attention, float32: each
    query's keys as one list in position order, so a token's output is the same bits in a decode
    step as in a verify block; prefill chunks keep XLA's, ``for_prefill``).
    attn_chunk: XLA prefix attention reads the committed cache in chunks of this many slots with
    a trip count that follows the rows' real lengths (0: one pass over every slot).
    small_rows: project 2..small_rows activation rows (batch x block) as one matrix-vector product
    per row instead of one skinny GEMM (whether that pays depends on the CPU's GEMM kernels;
    measured in benchmarks/projection_rows.py; 0 = always GEMM).
    rows_kernel: up to this many activation rows (a decode or verify block), projections and
    the vocab head run on the CPU rows kernel (models.cpu.rows_dot: packed weights read once for
    all rows, a row's result the same at any row count; float32 activations; the params need
    llama.pack_for_rows, which LoadedModel.params_for applies with a GGUF's Q4_1/Q8_0 weights
    kept in their blocks); 0 = XLA's dot. Launch scripts pick it with
    LoadedModel.auto_rows_kernel unless --rows_kernel says.
    rows_activations: what the rows kernel multiplies the GGUF weights with. "float32": the
    float32 model exactly. "int8": decode and verify blocks round each activation row to int8
    per group of 32 before the GGUF weights multiply it (as llama.cpp does; rows_dot.quantize_rows),
    so the weights meet integer codes (1.15-1.5x less time a step on an AVX2 CPU, BENCHMARKS.md).
    "bfloat16": each activation rounded to bfloat16, the weights' codes multiplied in pairs
    (vdpbf16ps on AVX512_BF16; rows_dot.rows_dot_bf16_reference). Under either the model is no
    longer the float32 one (the "low precision" modes): outputs may differ from float32, while
    each row's result still does not depend on the rows beside it, so speculation stays lossless
    against AR with the same options. Every decode and verify block then runs on the kernel
    whatever its row count (a block on XLA's float32 dot would compute the other model), and
    so do prefill chunks (``for_prefill``: the same model from the first token, at the low-precision
    dot products' speed; a prompt token is computed the same way whichever chunk or batch it is
    prefilled in, each row's projections being independent of the rows beside it). Float32 packs (weights not stored as
    Q4_1/Q8_0) keep float32 activations. The GGUF packs are then in another layout
    (rows_dot.pack_q4_1's ``pairs``; LoadedModel.params_for builds them). It needs attention
    "cpu": rounding to int8 turns a last-bit difference in an activation into a different code,
    so everything before it must give a token the same bits in a decode step as in a verify block,
    which XLA's attention (prefix and block summed apart) does not (9 of 26 Spec-Bench outputs
    differed from AR with it). With the CPU attention, the shape-independent RoPE tables
    (llama.rope_tables) and the RMS norms' fixed-order sums (``exact_blocks``) it does for any
    chain or token-tree block, in every mode (tests/test_rows_dot.py), so speculation under
    int8 or bfloat16 gives that mode's plain decoding's tokens.
    rope_once: compute the RoPE cos/sin tables once per forward behind a conditional, which
    XLA:CPU cannot fuse into (so re-evaluate in) every layer's rotation (llama.rope_tables;
    1 ms of a 9-row verify step on SmolLM2 at 1k context); None (default): on where jax's
    default backend is the CPU, off on accelerators, where a conditional waits for its
    predicate on the host.
    scan_layers: run the decoder layers as one ``lax.scan``, the cache's layer index the loop
    counter: the compiled program and its compile time do not grow with depth (80-layer
    targets; a 30-layer decode call compiles in a fraction of the unrolled one's seconds). Without
    the rows kernel the scan runs over stacked weights (params from llama.stack_layers: ``layers``
    one dict of [L, ...] arrays; on XLA:CPU its per-layer weight slices measured 1.6-10x slower
    decode steps). With it, the params keep the per-layer list and every block the kernel takes
    whole (decode, verify) loops over the kernel's stacks of packed weights, which it reads at
    the counter in place (llama.LAYER_PACKS); larger blocks and the layered prefill run as without.
    An int n > 1 (True is 1): n layers per iteration of the loop (``lax.scan``'s unroll), which
    buys back a loop's per-iteration cost for compile time: a SmolLM2 decode forward on the rows
    kernel (CPU attention) compiled in 0.8 s at 1 (steps 30% slower than the list's, which took
    5.5-6.6 s), 1.3-1.4 s at 5 (0-11% slower) and 2.0 s at 10 (the list's speed), BENCHMARKS.md.
    The launch scripts' defaults (EngineSpec's automatic settings) run the CPU attention and
    ``DEFAULT_SCAN_UNROLL`` layers per iteration wherever the rows kernel runs.
    prefill: these options run a prefill chunk (``for_prefill``): XLA's attention, which is
    allowed beside a low-precision mode here (a prompt is prefilled the same way for plain decoding and for
    speculation, so only decode and verify blocks need the CPU attention's equal bits)."""

    attention: str = "xla"
    attn_chunk: int = 256
    small_rows: int = 0
    rows_kernel: int = 0
    rows_activations: str = "float32"
    rope_once: bool | None = None
    scan_layers: int = 0
    prefill: bool = False

    def __post_init__(self):
        require(self.attention in ("xla", "pallas", "cpu"),
                f"unknown attention implementation {self.attention!r} (expected 'xla', 'pallas' or 'cpu')")
        require(self.attn_chunk >= 0, f"attn_chunk must be >= 0, got {self.attn_chunk}")
        require(self.small_rows >= 0, f"small_rows must be >= 0, got {self.small_rows}")
        require(self.rows_kernel >= 0, f"rows_kernel must be >= 0, got {self.rows_kernel}")
        require(self.scan_layers >= 0, f"scan_layers must be >= 0 (0: the per-layer list), got {self.scan_layers}")
        require(self.rows_activations in ROWS_ACTIVATIONS, f"rows_activations must be one of "
                f"{', '.join(ROWS_ACTIVATIONS)}, got {self.rows_activations!r}")
        low = self.rows_activations
        require(not self.rows_low or self.rows_kernel, f"rows_activations {low} needs the CPU rows kernel (rows_kernel > 0)")
        require(not self.rows_low or self.attention == "cpu" or self.prefill,
                f"rows_activations {low} needs attention 'cpu' (its outputs do not depend on how a token's keys are split between "
                "cache and block; XLA's do, by rounding, and its rounding turns that into other tokens)")
        require(not (self.scan_layers and self.attention == "pallas"),
                "scan_layers needs attention 'xla' (the Pallas kernel takes its cache layer as a static index)")

    def for_prefill(self) -> "ForwardOptions":
        """The options a prefill chunk runs with: XLA's attention for "cpu" (the kernel is for
        decode and verify blocks); under a low-precision ``rows_activations`` that kernel for every chunk, as for
        every decode block (its integer dot products multiply 2-4x faster than XLA's float32 dot
        on an AVX-512 VNNI CPU: benchmarks/rows_builds.py --per_weight --rows 128,512)."""
        return dataclasses.replace(self, attention="xla", prefill=True) if self.attention == "cpu" else self

    @property
    def exact_blocks(self) -> bool:
        """Whether a token's values must have the same bits in any decode or verify block (the CPU
        attention's promise): the RMS norms then sum in one fixed order (llama.rms_norm)."""
        return self.attention == "cpu"

    @property
    def scan_stacked(self) -> bool:
        """Whether the params' layers are one stacked dict (llama.stack_layers): ``scan_layers``
        without the rows kernel, whose scan reads its packs' stacks from the per-layer form."""
        return self.scan_layers and not self.rows_kernel

    def kernel_rows(self, rows: int) -> bool:
        """Whether a block of ``rows`` activation rows runs on the rows kernel."""
        return self.rows_low or rows <= self.rows_kernel

    @property
    def rows_low(self) -> bool:
        """Whether the rows kernel rounds activations (int8 or bfloat16): every block then runs on
        it, and the GGUF packs are in the paired layout (rows_dot.pack_q4_1's ``pairs``)."""
        return self.rows_activations != "float32"

    def rope_barrier(self) -> bool:
        """Whether forward computes the RoPE tables behind a conditional (``rope_once``, resolved)."""
        if self.rope_once is not None:
            return self.rope_once
        import jax

        return jax.default_backend() == "cpu"
