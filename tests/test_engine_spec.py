"""EngineSpec from the Python API: one frozen description, validated once (one-line errors),
the policy name parsed once (PolicySpec), and the code key that names the compiled engine."""

import dataclasses

import pytest

from specjax.engine.spec import DrafterSpec, EngineSpec, PolicySpec
from specjax.errors import SpecjaxError
from specjax.models.options import DEFAULT_SCAN_UNROLL, ForwardOptions


def test_policy_names_are_parsed_once():
    assert PolicySpec(" SmartSpec-Req ").name == "smartspec-req" and PolicySpec("smartspec-req").packed
    assert PolicySpec("0").name == "none" and PolicySpec("none").fixed_k == 0 and PolicySpec("4").fixed_k == 4
    assert PolicySpec("smartspec-conf").draft_first and PolicySpec("auto").goodput
    assert [PolicySpec(p).label for p in ("none", "3", "auto", "smartspec-conf")] == ["no-SD", "K=3", "SmartSpec",
                                                                                     "SmartSpec-conf"]
    for bad, msg in (("fast", "--policy must be auto"), ("-1", "--policy must be auto")):
        with pytest.raises(SpecjaxError, match=msg):
            PolicySpec(bad)
    with pytest.raises(SpecjaxError, match="confidence_threshold"):
        PolicySpec("smartspec-conf", threshold=1.0)


@pytest.mark.parametrize("kw, msg", [
    (dict(k_buckets=(1, 2)), "include 0"),
    (dict(drafter=DrafterSpec("prompt_lookup", k=2), policy=PolicySpec("3", fallback_k=2), k_buckets=(0, 2)),
     "--policy K=3 is not in --k_buckets"),
    (dict(drafter=DrafterSpec("prompt_lookup", k=8), policy=PolicySpec("auto", fallback_k=3)), "not a bucket"),
    (dict(policy=PolicySpec("2")), "needs a drafter"),
    (dict(drafter=DrafterSpec("suffix", k=8), policy=PolicySpec("smartspec-conf")), "needs a device drafter"),
    (dict(drafter=DrafterSpec("draft_model", k=8)), "needs --draft_model"),
    (dict(drafter=DrafterSpec("prompt_lookup", k=8, pld_min_ngram=3, pld_max_ngram=2)), "min_ngram <= max_ngram"),
    (dict(mesh="2by4"), "--mesh must be DATAxMODEL"),
    (dict(mesh="1x2", fwd=ForwardOptions(rows_kernel=32)), "--rows_kernel runs on one device"),
    (dict(batch_buckets=(0, 2)), "--batch_buckets must be >= 1"),
    (dict(prefill_chunk=100), "power of two"),
])
def test_a_bad_spec_is_a_one_line_error(kw, msg):
    with pytest.raises(SpecjaxError, match=msg) as e:
        EngineSpec(**kw)
    assert "\n" not in str(e.value)


def test_the_code_key_follows_what_is_compiled():
    class Model:  # (what resolved() asks of a LoadedModel)
        def auto_rows_kernel(self):
            return 32

    spec = EngineSpec(drafter=DrafterSpec("layer_skip", k=8), k_buckets=(8, 0, 4, 4), rows_kernel_auto=True)
    assert spec.k_buckets == (0, 4, 8)  # sorted, once each
    with pytest.raises(SpecjaxError, match="resolved"):
        spec.code_key()
    run = spec.resolved(Model())
    assert run.fwd.rows_kernel == 32 and "rows_kernel=32" in run.code_key() and "int8" not in run.code_key()
    # --rows_activations int8 with --rows_kernel -1: int8 activations (and the CPU attention) if the kernel resolves on
    run8 = dataclasses.replace(spec, rows_activations_auto="int8").resolved(Model())  # (with a drafter: speculation is lossless)
    assert run8.fwd.rows_activations == "int8" and "rows_activations=int8" in run8.code_key() and "attention=cpu" in run8.code_key()
    trees8 = dataclasses.replace(spec, drafter=DrafterSpec("suffix", k=8), rows_activations_auto="bfloat16")  # token trees too
    assert trees8.resolved(Model()).fwd.rows_activations == "bfloat16"
    assert EngineSpec(rows_activations_auto="int8").resolved(Model()).fwd.rows_activations == "float32"  # rows kernel 0: float32
    # --rows_activations auto (the default): bfloat16 where the CPU multiplies it natively and the kernel reads GGUF
    # blocks, else float32
    from specjax.models.cpu import rows_dot

    class Gguf(Model):
        native_packs = object()

    for native, model, want in ((True, Gguf(), "bfloat16"), (False, Gguf(), "float32"), (True, Model(), "float32")):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(rows_dot, "native_bf16", lambda native=native: native)
            got = dataclasses.replace(spec, rows_activations_auto="auto").resolved(model).fwd
        assert got.rows_activations == want and (want == "float32" or got.attention == "cpu"), (native, want)
    assert EngineSpec(mesh="1x2", rows_kernel_auto=True).rows_kernel_auto is False  # never the kernel on a mesh
    # the launch defaults (--attention_impl auto, --scan_layers -1): the CPU attention and the layers as a loop of
    # DEFAULT_SCAN_UNROLL where the rows kernel runs; XLA's attention and the per-layer list where it does not
    auto = dict(attention_auto=True, scan_auto=True)
    on = dataclasses.replace(spec, **auto).resolved(Model())
    assert (on.fwd.attention, on.fwd.scan_layers, on.auto) == ("cpu", DEFAULT_SCAN_UNROLL, False)
    assert "attention=cpu" in on.code_key() and f"scan_layers={DEFAULT_SCAN_UNROLL}" in on.code_key()
    off = EngineSpec(**auto).resolved(Model())  # (rows kernel 0, not automatic)
    assert (off.fwd.attention, off.fwd.scan_layers) == ("xla", 0)
    xla = dataclasses.replace(spec, scan_auto=True).resolved(Model())  # XLA's attention chosen: no loop (its cache copies)
    assert (xla.fwd.attention, xla.fwd.scan_layers) == ("xla", 0)
    mine = dataclasses.replace(spec, fwd=ForwardOptions(scan_layers=2), attention_auto=True).resolved(Model())
    assert (mine.fwd.attention, mine.fwd.scan_layers) == ("cpu", 2)  # a loop the user chose is kept
    assert dataclasses.replace(run, dtype="bfloat16").code_key() != run.code_key()
    # a host drafter and a device drafter of the same forward options run the same target code
    assert dataclasses.replace(run, drafter=DrafterSpec("suffix", k=8)).code_key() == run.code_key()


@pytest.mark.parametrize("flags_in,want", [
    (("auto", "auto", -1), ("float32", "auto", "xla")),  # the defaults: decided with the model (EngineSpec.resolved)
    (("auto", "cpu", 32), ("float32", "auto", "cpu")),
    (("auto", "xla", -1), ("float32", "", "xla")),  # an explicit XLA attention keeps float32
    (("float32", "auto", -1), ("float32", "", "xla")),
    (("int8", "auto", 32), ("int8", "", "cpu")),  # the kernel named: set now, with the CPU attention
    (("bfloat16", "auto", -1), ("float32", "bfloat16", "xla")),  # the kernel automatic: if it resolves on
])
def test_rows_activation_flags(flags_in, want):
    from specjax.cli import rows_activation_settings

    assert rows_activation_settings(*flags_in) == want


@pytest.mark.parametrize("flags_in", [("int8", "auto", 0), ("bfloat16", "pallas", -1)])
def test_a_rounding_mode_without_the_kernel_or_beside_pallas_is_a_one_line_error(flags_in):
    from specjax.cli import rows_activation_settings

    with pytest.raises(SpecjaxError, match=f"--rows_activations {flags_in[0]} needs the rows kernel") as e:
        rows_activation_settings(*flags_in)
    assert "\n" not in str(e.value)
