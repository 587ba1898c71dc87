"""Sharding hooks: logical-axis rules on a fake 8-device CPU mesh.

Runs in a subprocess because the fake device count must be set before JAX starts.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from jax.sharding import PartitionSpec as P

from specjax import sharding as sh
from specjax.config import get_model_config

_SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax, numpy as np
    from specjax import sharding as sh
    from specjax.config import get_model_config
    from specjax.generate import Generator
    from specjax.models import llama

    assert len(jax.devices()) == 8
    cfg = get_model_config("tiny-random")
    params = llama.init_random_params(cfg, 0)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]]
    want = [r.tokens for r in Generator(cfg, params).generate(prompts, max_new_tokens=12)]
    for data, model in [(2, 4), (1, 8), (8, 1)]:
        mesh = sh.make_mesh(data, model)
        sp = sh.Layout(mesh).put_params(cfg, params)
        assert sp["layers"][0]["w_gate"].sharding.spec == sh.logical_to_spec(("embed", "mlp"), (64, 128), mesh)
        got = [r.tokens for r in Generator(cfg, sp).generate(prompts, max_new_tokens=12)]
        assert got == want, (data, model, got, want)
    print("SHARDED_OK")
""")


def _run_fake_devices(args, timeout=600):
    env = dict(os.environ)  # (the scripts add the device count to the suite's XLA_FLAGS)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_sharded_generation_matches_single_device():
    r = _run_fake_devices(["-c", _SCRIPT])
    assert "SHARDED_OK" in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize("meshes", ["2x4", pytest.param("1x2,2x4,4x2,8x1", marks=pytest.mark.slow)])
def test_sharded_engine_matches_unsharded(meshes):
    """Must-show of the scale issue: the serving engine on meshes of fake devices (every prefill,
    chain / tree step and row operation compiled for the layout's shardings) gives the unsharded
    engine's tokens for prompt lookup, suffix trees and a draft model, greedy and sampled; see
    sharded_engine_run.py. By default 2x4 (rows split over 2, the model over 4); under ``slow``
    also 1x2, 4x2 and 8x1."""
    r = _run_fake_devices([os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharded_engine_run.py"), meshes])
    assert "SHARDED_ENGINE_OK" in r.stdout, (r.stdout[-2000:], r.stderr[-3000:])


def test_engine_compiles_ahead_of_time_for_70b_and_8b_layouts():
    """Abstract-param compilation on fake devices: golden layouts of 70B TP=8, 8B 2x2 and Qwen2.5-7B
    TP=4, the state in and out of a step in the same shardings, the compiled argument bytes equal
    to one device's exact share, and one-line errors for meshes and KV budgets that do not fit
    (aot_run.py)."""
    r = _run_fake_devices([os.path.join(os.path.dirname(os.path.abspath(__file__)), "aot_run.py")])
    assert "AOT_OK" in r.stdout, (r.stdout[-2000:], r.stderr[-3000:])


def test_sharded_safetensors_load_straight_into_shards(tmp_path):
    """A 3-file checkpoint with its index, loaded by weights.load_safetensors_sharded on meshes 2x4
    and 1x2: the placed params, each device reading only its slice; a tensor missing from the index
    or of the wrong shape: one-line errors naming the config and the mesh (sharded_load_run.py)."""
    r = _run_fake_devices([os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharded_load_run.py"),
                           str(tmp_path)])
    assert "LOAD_OK" in r.stdout, (r.stdout[-2000:], r.stderr[-3000:])


def test_batch_job_refuses_a_mesh_larger_than_the_machine(tmp_path):
    """launch/batch.py --mesh 4x4 on 8 (fake) devices: one line, exit 2, before the model load
    (the batch job on a mesh is run, from a sharded checkpoint, by the two-process test below)."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch", "batch.py")
    (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
    r = subprocess.run([sys.executable, script, "--model", "tiny-random", "--input_jsonl", str(tmp_path / "in.jsonl"),
                        "--output_jsonl", str(tmp_path / "x.jsonl"), "--mesh", "4x4"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "error: mesh data=4 x model=4 needs 16 devices; 8 cpu device(s) present"), r.stderr[-2000:]


def test_two_processes_split_a_sharded_batch_job_and_merge_it(tmp_path):
    """Must-show of the scale issue: launch/batch.py as two processes (jax.distributed over a
    local coordinator, 4 fake devices each, the engine on a 1x2 mesh of each process's devices,
    the model a 2-file safetensors checkpoint loaded straight into the shards) serves the records
    split between them and the last to finish merges the parts: the same records as one process
    on one device, in input order; merging again gives the same bytes. Bad process flags are
    one-line errors."""
    import json
    import socket

    from specjax.models import llama, weights

    cfg = get_model_config("tiny-random")
    model_dir = str(tmp_path / "tiny-hf")
    weights.save_safetensors_params(llama.init_random_params(cfg, 0), cfg, model_dir, shards=2)

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch", "batch.py")
    inp = tmp_path / "in.jsonl"
    recs = [{"id": f"r{i}", "prompt": "one two one two " * (1 + i % 4), "max_new_tokens": 6 + i % 5} for i in range(9)]
    recs[4] = {"id": "r1", "prompt": "a repeated id"}  # an error record, whichever replica owns the line
    recs[7] = {"id": "r7", "prompt": "sampled", "max_new_tokens": 8, "temperature": 0.9, "seed": 3}
    inp.write_text("".join(json.dumps(r) + "\n" for r in recs))
    # one batch bucket: every run compiles (or loads) half the executables of two; bucket resizes
    # are covered in-process (test_engine.py), the sharded ones by sharded_engine_run.py
    geom = ["--model", model_dir, "--batch_buckets", "4", "--k_buckets", "0,2", "--num_spec_tokens", "2",
            "--slots", "128", "--input_jsonl", str(inp)]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
               SPECJAX_CACHE_DIR=str(tmp_path / "cache"))
    one = tmp_path / "one.jsonl"
    # twice: the second run loads its executables from the disk cache, onto one of the 4 devices
    # (they were once loaded onto all 4 of them, and every step failed)
    for out_one in (tmp_path / "first.jsonl", one):
        r = subprocess.run([sys.executable, script, *geom, "--output_jsonl", str(out_one)], capture_output=True,
                           text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(one.read_text().splitlines()) == sorted((tmp_path / "first.jsonl").read_text().splitlines())
    assert '"error"' not in one.read_text().replace('"id": "#5", "error"', "")
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    out = tmp_path / "two.jsonl"

    def cmd(k):
        return [sys.executable, script, *geom, "--output_jsonl", str(out), "--mesh", "1x2", "--num_processes", "2",
                "--process_id", str(k), "--coordinator_address", f"localhost:{port}"]

    procs = [subprocess.Popen(cmd(k), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for k in (0, 1)]
    errs = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for e in errs]
    assert sum("[merged 9 records of 2 replicas" in e for e in errs) >= 1, errs
    merged = out.read_bytes()
    lines = merged.decode().splitlines()
    assert [json.loads(x)["id"] for x in lines] == [r["id"] if i != 4 else "#5" for i, r in enumerate(recs)]
    assert sorted(lines) == sorted(one.read_text().splitlines())
    parts = [(tmp_path / f"two.jsonl.replica{k}of2").read_text().splitlines() for k in (0, 1)]
    assert [len(p) for p in parts] == [5, 4]  # records 0, 2, .. and 1, 3, .. of the input
    # merging again (a finished replica run again does this) gives the same bytes
    from specjax.jobs import merge_replicas
    from specjax.results import REQUEST_FIELDS, request_fields

    raw = dict.fromkeys(REQUEST_FIELDS) | {"max_new_tokens": 128, "temperature": 0.0, "top_k": 0, "top_p": 1.0,
                                           "seed": 0}
    out.unlink()
    assert merge_replicas(str(inp), str(out), 2, request_fields(raw, raw)) == 9 and out.read_bytes() == merged
    (tmp_path / "two.jsonl.replica1of2").write_bytes(b"")  # a part that lost its records: no merge
    assert merge_replicas(str(inp), str(out), 2, request_fields(raw, raw)) is None
    r = subprocess.run([sys.executable, script, *geom, "--output_jsonl", str(out), "--num_processes", "2",
                        "--process_id", "2", "--coordinator_address", "localhost:1"], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: --process_id must be in 0..1")


def test_draft_pairs_name_configs_with_the_same_tokenizer():
    from specjax.config import available_models

    pairs = {n: get_model_config(n).draft for n in available_models()}
    assert {pairs[n] for n in ("vicuna-7b", "llama2-70b", "llama3-70b", "qwen2.5-72b")} == {
        "llama-160m", "tinyllama-1.1b", "llama3.2-1b", "qwen2.5-0.5b"}
    for name, draft in pairs.items():
        if draft:
            t, d = get_model_config(name), get_model_config(draft)
            # the same ids; Qwen2.5 7B/72B pad their embedding past the 0.5B's (unused ids)
            assert d.vocab_size == t.vocab_size or (d.vocab_size < t.vocab_size and t.arch == "qwen2"), name
            assert d.num_params() < t.num_params() / 2, name


class _FakeMesh:
    """Just enough of a Mesh for logical_to_spec (shape lookup)."""

    def __init__(self, **shape):
        self.shape = shape


def test_golden_layouts_of_large_configs():
    mesh = _FakeMesh(data=2, model=8)
    golden = {
        # name: (wq, wk, w_down, embed) specs under 8-way tensor parallelism
        "llama2-70b": (P(None, "model"), P(None, "model"), P("model", None), P("model", None)),
        "llama3-8b": (P(None, "model"), P(None, "model"), P("model", None), P("model", None)),
        "llama2-7b": (P(None, "model"), P(None, "model"), P("model", None), P("model", None)),
        # 52 heads do not divide over 8 shards (use 4-way TP for it, checked below): replicated.
        "vicuna-33b": (P(None, None), P(None, None), P("model", None), P("model", None)),
        # 14 heads and 2 KV heads do not divide over 8 shards: replicated rather than splitting a head.
        "qwen2.5-0.5b": (P(None, None), P(None, None), P("model", None), P("model", None)),
    }
    for name, (wq, wk, wd, emb) in golden.items():
        cfg = get_model_config(name)
        ab = sh.abstract_params(cfg)
        units = sh.head_units(cfg)
        specs = {
            "wq": sh.logical_to_spec(("embed", "heads"), ab["layers"][0]["wq"].shape, mesh, units=units),
            "wk": sh.logical_to_spec(("embed", "kv_heads"), ab["layers"][0]["wk"].shape, mesh, units=units),
            "w_down": sh.logical_to_spec(("mlp", "embed"), ab["layers"][0]["w_down"].shape, mesh),
            "embed": sh.logical_to_spec(("vocab", "embed"), ab["embed"].shape, mesh),
        }
        assert specs["wq"] == wq and specs["wk"] == wk and specs["w_down"] == wd, (name, specs)
        assert len(ab["layers"]) == cfg.num_layers
        assert specs["embed"] == emb, (name, specs)
    v33 = get_model_config("vicuna-33b")
    spec4 = sh.logical_to_spec(("embed", "heads"), sh.abstract_params(v33)["layers"][0]["wq"].shape,
                               _FakeMesh(data=1, model=4), units=sh.head_units(v33))
    assert spec4 == P(None, "model")


def test_indivisible_dims_are_replicated():
    mesh = _FakeMesh(data=1, model=2)
    assert sh.logical_to_spec(("embed", "kv_heads"), (576, 3), mesh) == P(None, None)
    assert sh.logical_to_spec(("embed", "kv_heads"), (576, 4), mesh) == P(None, "model")
    assert sh.logical_to_spec(("batch",), (3,), _FakeMesh(data=2, model=1)) == P(None)
    # A mesh axis is used at most once per array.
    assert sh.logical_to_spec(("heads", "mlp"), (8, 8), mesh) == P("model", None)
