"""The strict request schema (specjax.results) through the Python API: whatever values a caller
passes, SamplingParams / validate_request / request_fields either raise SpecjaxError naming the
field or accept values that the device arrays hold exactly; and requests at the edges of the
schema run on the tiny model without an error."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specjax.errors import SpecjaxError
from specjax.generate import Generator
from specjax.results import INT32_MAX, REQUEST_FIELDS, request_fields, validate_request
from specjax.sampling import SamplingArrays, SamplingParams

SETTINGS = settings(deadline=None, database=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])

anything = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-5, 5), st.floats(), st.floats(-2, 2),
    st.sampled_from([0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 10**12, 10**300, 1e300, 1e-320, 2.9, 3.0, -0.0,
                     float("nan"), float("inf"), 1e-4, 1e4, np.int64(3), np.int32(-1), np.uint32(2**32 - 1),
                     np.float32(0.5), np.bool_(True), np.float64("nan")]),
    st.text(max_size=3), st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=1), st.integers(),
                                                                              max_size=1),
)


@settings(SETTINGS)
@given(anything, anything, anything, anything)
def test_sampling_params_accept_only_what_the_device_holds(t, k, p, s):
    try:
        sp = SamplingParams(temperature=t, top_k=k, top_p=p, seed=s)
    except SpecjaxError as e:
        assert str(e).split()[0] in ("temperature", "top_k", "top_p", "seed")
        return
    assert type(sp.temperature) is float and type(sp.top_p) is float
    assert type(sp.top_k) is int and type(sp.seed) is int
    for v in (t, k, p, s):
        assert not isinstance(v, (bool, np.bool_))
    assert sp.temperature == 0 or 1e-4 <= sp.temperature <= 1e4
    assert 0 < sp.top_p <= 1 and 0 <= sp.top_k <= INT32_MAX and 0 <= sp.seed < 2**32
    arr = SamplingArrays.build([sp], 2)  # the host -> device step that raised OverflowError before
    assert int(arr.top_k[0]) == sp.top_k and int(arr.seed[0]) == sp.seed
    assert math.isfinite(float(arr.temperature[0])) and float(arr.top_p[0]) <= 1


@settings(SETTINGS)
@given(st.dictionaries(st.sampled_from(REQUEST_FIELDS + ("other",)), anything, max_size=5))
def test_request_fields_raise_only_schema_errors(obj):
    defaults = dict(max_new_tokens=8, temperature=0.0, top_k=0, top_p=1.0, seed=0)
    try:
        f = request_fields(obj, defaults)
    except SpecjaxError as e:
        assert str(e).split()[0] in REQUEST_FIELDS
        return
    assert set(f) == set(REQUEST_FIELDS) and 1 <= f["max_new_tokens"] <= INT32_MAX
    SamplingParams(temperature=f["temperature"], top_k=f["top_k"], top_p=f["top_p"], seed=f["seed"])


class _Cfg:
    name, vocab_size, max_position = "cfg", 256, 1024


token = st.one_of(st.integers(-3, 300), st.sampled_from([True, 1.0, 2.9, np.int64(5), np.uint8(7), "1", None]))


@settings(SETTINGS)
@given(st.one_of(st.lists(token, max_size=4), st.text(max_size=3), st.none(), st.integers()), anything)
def test_validate_request_raises_only_schema_errors(prompt, mnt):
    try:
        validate_request(prompt, mnt, _Cfg)
    except SpecjaxError:
        return
    assert 1 <= int(mnt) <= INT32_MAX and not isinstance(mnt, (bool, float))
    assert all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 0 <= t < 256 for t in prompt)


@pytest.mark.parametrize("kw, needle", [
    (dict(top_k=True), "top_k must be an integer, got True (bool)"),
    (dict(seed=2.9), "seed must be an integer, got 2.9 (float)"),
    (dict(top_k=10**12), "top_k must be an integer in [0, 2147483647]"),
    (dict(temperature=1e-300), "temperature must be 0 (greedy) or in [0.0001, 10000]"),
    (dict(top_p=float("nan")), "top_p must be in (0, 1]"),
])
def test_values_the_old_checks_let_through(kw, needle):
    with pytest.raises(SpecjaxError) as e:
        SamplingParams(**kw)
    assert needle in str(e.value)


def test_generate_rejects_mistyped_arguments_before_the_device(tiny):
    cfg, params = tiny
    gen = Generator(cfg, params)
    for prompts, kw, needle in [([[1, 2.9]], {}, "out of range"), ([[1, True]], {}, "out of range"),
                                ([[1]], dict(max_new_tokens=2.0), "max_new_tokens must be an integer"),
                                ([[1]], dict(max_new_tokens=True), "max_new_tokens must be an integer"),
                                ([[1]], dict(sampling=[{"temperature": 1}]), "SamplingParams"),
                                (["hello"], {}, "sequence of token ids")]:
        with pytest.raises(SpecjaxError, match=needle):
            gen.generate(prompts, **kw)


def test_requests_at_the_edges_of_the_schema_run(tiny):
    """The largest values the schema accepts reach the device without an error: max_new_tokens
    2**31 - 1 (clamped to the context), top_k 2**31 - 1, the largest seed, the extreme
    temperatures and the smallest top_p."""
    cfg, params = tiny
    cfg = dataclasses.replace(cfg, max_position=64)  # a short context: small shapes to compile
    gen = Generator(cfg, params, batch_buckets=(2,))
    edge = [SamplingParams(temperature=1e4, top_k=2**31 - 1, top_p=5e-324, seed=2**32 - 1),
            SamplingParams(temperature=1e-4, top_k=1, top_p=1.0, seed=np.uint32(2**32 - 1))]
    out = gen.generate([[3] * (cfg.max_position - 4), [5, 6] * (cfg.max_position // 2 - 3)], edge,
                       max_new_tokens=2**31 - 1)
    assert [len(o.tokens) for o in out] == [3, 5] and {o.finish_reason for o in out} == {"length"}
    for o in out:
        assert all(0 <= t < cfg.vocab_size for t in o.tokens)
