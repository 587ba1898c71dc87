"""The feature-head training pipeline (distill.head_data, distill.head_pipeline) on the tiny model:
shards read back bit-exactly and a damaged one is caught and written again alone; a run killed at
a random step (and later stopped by SIGTERM) and resumed ends with the uninterrupted run's head;
the data-parallel step on a fake 8-device mesh equals the single-device step; the learning rate
warms up, then decays along a cosine over the planned steps; the heads the pipeline trains serve
losslessly (greedy equal to AR through the engine); self-written prompts start from given
openings; several data sets train as one."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from specjax.distill import eagle_train as et
from specjax.distill import head_data as hd
from specjax.distill import head_pipeline as hp
from specjax.distill import train as tr
from specjax.drafters import eagle, medusa
from specjax.errors import SpecjaxError

SETTINGS = hd.DataSettings(max_new_tokens=12, max_prompt=32, chat=False, topk=4, eval_sequences=6, shard_size=8,
                           temperatures=(0.0, 1.0), gen_batch=8, seed=0)


def quiet(msg: str) -> None:
    pass


@pytest.fixture(scope="module")
def model():
    from specjax.models.loader import load_model

    return load_model("tiny-random")


@pytest.fixture(scope="module")
def data(model, tmp_path_factory):
    """An EAGLE data set of the tiny model: 40 prompt lines, 4 of them repeats (case, spaces)."""
    root = tmp_path_factory.mktemp("head_data")
    lines = [{"prompt": f"row {i}: " + "ab " * (i % 5) + "xyz"[i % 3]} for i in range(36)]
    lines += [{"question": "  ROW 3: " + "ab " * 3 + "x"}, {"prompt": lines[5]["prompt"].upper()},
              {"turns": [lines[7]["prompt"], "more"]}, {"text": lines[9]["prompt"] + "  "}]
    path = root / "prompts.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    st = dataclasses.replace(SETTINGS, prompt_files=(str(path),))
    ds = hd.build_data(model, str(root / "eagle"), st, eagle.KIND.features(model.cfg), log=quiet)
    return root, st, ds


def run_config(ck, **kw) -> hp.RunConfig:
    base = dict(checkpoint_dir=str(ck), batch=4, window=16, context=4, epochs=1.5, checkpoint_minutes=0,
                checkpoint_steps=3, log_every=4, eval_every=0, engine_eval_every=0, draft_vocab=64, k=3, unroll=2,
                seed=1, eval_prompts=2)
    return hp.RunConfig(**{**base, **kw})


TC = tr.TrainConfig(lr=3e-3)


@pytest.fixture(scope="module")
def trained(model, data, tmp_path_factory):
    """An uninterrupted EAGLE run (with the held-out estimates, the engine's measurement and the
    plot along the way: they read the head, never change it)."""
    ck = tmp_path_factory.mktemp("eagle_run")
    rc = run_config(ck / "head", eval_every=5, engine_eval_every=10, plot=str(ck / "curve.png"))
    return rc, hp.train(eagle.KIND, model, data[2], rc, TC, log=quiet)


def test_shards_round_trip_bit_exactly_and_a_damaged_one_is_caught(model, data, tmp_path, caplog):
    """What write_shard writes read_shard maps back bit for bit (bfloat16 features and logits);
    a flipped byte makes the shard unreadable with one warning; build_data writes that shard again
    (the same bytes: its content is a function of the settings and its index) and no other.
    Prompts are deduplicated (4 of the 40 lines repeat others)."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    seqs = [et.HeadSequence(rng.integers(0, 256, n).astype(np.int32), n // 3,
                            rng.standard_normal((n, 12)).astype(np.float32),
                            rng.integers(0, 256, (n, 4)).astype(np.int32),
                            rng.standard_normal((n, 4)).astype(np.float32)) for n in (5, 9, 1)]
    hd.write_shard(str(tmp_path), "train-00000", seqs, [0.0, 0.7, 1.0], {"prompt_keys": []})
    sh = hd.read_shard(str(tmp_path), "train-00000")
    assert len(sh) == 3 and sh.temps.tolist() == pytest.approx([0.0, 0.7, 1.0])
    bf16 = np.dtype(ml_dtypes.bfloat16)
    for i, s in enumerate(seqs):
        got = sh.sequence(i)
        assert got.start == s.start and np.array_equal(got.tokens, s.tokens) and np.array_equal(got.ids, s.ids)
        for a, b in ((got.feats, s.feats), (got.logits, s.logits)):
            assert a.dtype == bf16 and np.array_equal(a.view(np.uint16), b.astype(bf16).view(np.uint16))
    path = tmp_path / "train-00000.bin"
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x10
    path.write_bytes(bytes(blob))
    with caplog.at_level(logging.WARNING):
        assert hd.read_shard(str(tmp_path), "train-00000") is None
        assert hd.read_shard(str(tmp_path), "train-00000") is None
    assert sum("train-00000.bin" in r.getMessage() for r in caplog.records) == 1

    root, st, ds = data
    assert sum(len(s) for s in ds.train) + len(ds.eval) == 36 and len(ds.eval) == 6
    d = root / "eagle"
    want = (d / "train-00001.bin").read_bytes()
    others = {f: os.stat(d / f).st_mtime_ns for f in os.listdir(d) if f.endswith(".bin") and "00001" not in f}
    blob = bytearray(want)
    blob[100] ^= 1
    (d / "train-00001.bin").write_bytes(bytes(blob))
    again = hd.build_data(model, str(d), st, eagle.KIND.features(model.cfg), log=quiet)
    assert (d / "train-00001.bin").read_bytes() == want
    assert {f: os.stat(d / f).st_mtime_ns for f in others} == others
    assert again.digest() == ds.digest()


def test_windows_cover_every_trained_position_once(data):
    """Every position from a sequence's prompt's last on is trained in exactly one window, and an
    attending head's later windows start ``context`` positions before their trained ones."""
    _, _, ds = data
    for C, prompt_loss in ((4, False), (0, True), (1, False)):
        rows, counts = hp.windows(ds.train, 16, C, prompt_loss)
        seen: dict = {}
        for (s, q, a, first), n in zip(rows.tolist(), counts.tolist()):
            assert first - a <= C and 0 < n <= 16 - (first - a)
            for p in range(first, first + n):
                seen[(s, q, p)] = seen.get((s, q, p), 0) + 1
        want = {(s, q, p) for s, sh in enumerate(ds.train) for q in range(len(sh))
                for p in range(0 if prompt_loss else int(sh.starts[q]), int(sh.lengths()[q]))}
        assert set(seen) == want and set(seen.values()) == {1}


def test_schedule_warms_up_then_decays_along_a_cosine_over_the_planned_steps():
    """The token budget plans the steps (budget / mean training tokens per step); the learning
    rate rises linearly to its peak over the warm-up, then follows a cosine to lr x
    final_lr_fraction at the planned end."""
    rows = np.zeros((100, 4), np.int64)
    counts = np.full(100, 50, np.int64)
    order = hp.Order(rows, counts, 8, seed=0)
    rc = hp.RunConfig(checkpoint_dir="unused", batch=8, train_tokens=400 * 1000, warmup_fraction=0.05)
    tc = hp.plan(order, rc, tr.TrainConfig(lr=1e-3, final_lr_fraction=0.1))
    assert tc.total_steps == 1000 and tc.warmup_steps == 50
    lr = tr.schedule(tc)
    assert float(lr(0)) == 0 and float(lr(25)) == pytest.approx(0.5e-3) and float(lr(50)) == pytest.approx(1e-3)
    for s in (50, 300, 525, 800, 1000):
        cos = 0.5 * (1 + np.cos(np.pi * (s - 50) / 950))
        assert float(lr(s)) == pytest.approx(1e-4 + 0.9e-3 * cos, rel=1e-5), s
    assert float(lr(2000)) == pytest.approx(1e-4)
    epochs = hp.plan(order, hp.RunConfig(checkpoint_dir="unused", batch=8, epochs=2.5), tr.TrainConfig())
    assert epochs.total_steps == 30  # (12 batches per epoch)
    # the order: a permutation per epoch, keyed by (seed, epoch), the same for the same step
    assert sorted(np.concatenate([order.at(s) for s in range(12)]).tolist()) == sorted(
        np.random.default_rng([0, 0]).permutation(100)[:96].tolist())
    assert order.at(13).tolist() == hp.Order(rows, counts, 8, seed=0).at(13).tolist() != order.at(1).tolist()


def test_chain_walk_verifies_as_the_engine_does():
    """The held-out estimate walks each row as verification would: a step accepts its chain's
    leading hits (where valid) plus one token, and the next starts after them."""
    hits = np.ones((2, 12, 3), bool)
    valid = np.zeros((2, 12, 3), bool)
    for j in range(3):
        valid[0, 1:11 - j, j] = True  # positions 1..10 trained: chains end at the window's end
    hits[1, :, 1] = False  # row 2: draft 2 always misses, so a step accepts 1 draft
    valid[1, :6] = True
    valid[1, 6:, :] = False
    top1, tps = hp.chain_walk(hits, valid)
    # row 1: steps at 1 (3 + 1), 5 (4), 9 (positions 9, 10 valid: 2 + 1): 11 tokens in 3 steps;
    # row 2: steps at 0, 2, 4 (1 + 1 each): 6 tokens in 3 steps
    assert top1 == 1.0 and tps == pytest.approx(17 / 6)


def test_a_killed_run_resumes_to_the_uninterrupted_head(model, data, trained, tmp_path, seed):
    """Killed (no save) after a random number of steps, started again (it resumes from the last
    checkpoint), stopped by SIGTERM a few steps later (it finishes the step, checkpoints and
    returns), started again: the final head equals the uninterrupted run's, and the head saved in
    the directory records the training tokens it has seen."""
    rc0, full = trained
    planned = full["planned"]
    assert planned >= 8 and full["stopped"] is None
    kill = 1 + seed % (planned - 2)
    rc = run_config(tmp_path / "head")
    got = hp.train(eagle.KIND, model, data[2], rc, TC, log=quiet, kill_after=kill)
    assert got["stopped"] == "killed" and got["step"] == kill

    def term(msg):  # SIGTERM to this process during the step after the resumed run's first line
        if msg.startswith("step "):
            os.kill(os.getpid(), signal.SIGTERM)

    got = hp.train(eagle.KIND, model, data[2], dataclasses.replace(rc, log_every=1), TC, log=term)
    assert got["stopped"] == "SIGTERM" and got["step"] < planned, (seed, got["step"])
    lines = []
    got = hp.train(eagle.KIND, model, data[2], rc, TC, log=lines.append)
    assert got["step"] == planned and got["tokens"] == full["tokens"], (seed, lines)
    assert any(f"resumed {rc.checkpoint_dir} at step" in m for m in lines)
    for k in full["trainable"]:
        for a, b in zip(_leaves(full["trainable"][k]), _leaves(got["trainable"][k])):
            np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7, err_msg=f"seed {seed}: killed at step {kill}")
    spec = eagle.read_spec(rc.checkpoint_dir, model.cfg)
    assert spec["training"]["tokens"] == full["tokens"] and spec["training"]["steps"] == planned
    snaps = sorted(os.listdir(os.path.join(rc0.checkpoint_dir, "snapshots")))
    assert snaps and snaps[-1] == f"tokens-{full['tokens']:012d}"
    # a run with other settings in the same directory is refused in one line
    with pytest.raises(SpecjaxError, match="trains a run of other settings"):
        hp.train(eagle.KIND, model, data[2], dataclasses.replace(rc, batch=2), TC, log=quiet)


def _leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)


def test_the_pipelines_heads_serve_losslessly(model, data, trained, tmp_path):
    """The EAGLE head the pipeline saved, and Medusa heads trained on the same text (its data set
    written from the EAGLE one's, features recomputed), serve through the engine at K = 3 with
    greedy outputs equal to AR; the run drew its curve and measured held-out acceptance."""
    from specjax import registry
    from specjax.generate import Generator

    rc, full = trained
    assert os.path.getsize(os.path.dirname(rc.checkpoint_dir) + "/curve.png") > 0
    root, st, ds = data
    prompts = [ds.eval.prompt(i) for i in range(len(ds.eval))]
    ar = [r.tokens for r in Generator(model.cfg, model.params).generate(prompts, max_new_tokens=16)]
    gen = registry.build_spec_generator(model, "eagle", k=3, k_buckets=(0, 3), eagle_head=rc.checkpoint_dir)
    assert [r.tokens for r in gen.generate(prompts, max_new_tokens=16, num_spec_tokens=3)] == ar

    mst = dataclasses.replace(st, texts_from=str(root / "eagle"))
    mds = hd.build_data(model, str(tmp_path / "medusa_data"), mst, medusa.KIND.features(model.cfg), log=quiet)
    assert [s.tokens.tolist() for s in (mds.train[0], mds.eval)] == [s.tokens.tolist() for s in (ds.train[0], ds.eval)]
    with pytest.raises(SpecjaxError, match="keeps the target features"):
        hp.train(medusa.KIND, model, ds, run_config(tmp_path / "m"), TC, log=quiet)
    mrc = run_config(tmp_path / "medusa", settings=(("heads", 3),), eval_every=4)
    got = hp.train(medusa.KIND, model, mds, mrc, TC, log=quiet)
    assert got["step"] == got["planned"]
    saved = json.loads(open(os.path.join(mrc.checkpoint_dir, medusa.KIND.file)).read())
    assert saved["heads"] == 3 and saved["tree"]  # (with the tree their held-out accuracy makes best)
    gen = registry.build_spec_generator(model, "medusa", k=3, k_buckets=(0, 3), medusa_head=mrc.checkpoint_dir)
    assert [r.tokens for r in gen.generate(prompts, max_new_tokens=16, num_spec_tokens=3)] == ar
    # fine-tuning them (--init_head): their saved tree is not a training setting; other heads are refused
    tuned = hp.train(medusa.KIND, model, mds, run_config(tmp_path / "mtuned", settings=(("heads", 3),),
                                                         init_head=mrc.checkpoint_dir), TC, log=quiet, kill_after=1)
    assert tuned["step"] == 1
    with pytest.raises(SpecjaxError, match="head of other settings"):
        hp.train(medusa.KIND, model, mds, run_config(tmp_path / "m4", settings=(("heads", 4),),
                                                     init_head=mrc.checkpoint_dir), TC, log=quiet)


_MESH = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from specjax.config import get_model_config
    from specjax.distill import eagle_train as et, head_online, head_pipeline as hp, train as tr
    from specjax.drafters import eagle, heads, medusa
    from specjax.models import llama

    assert len(jax.devices()) == 8
    cfg = get_model_config("tiny-random")
    params = llama.init_random_params(cfg, 0)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, 255, 3 + i % 4)] for i in range(10)]
    outs = [[int(t) for t in rng.integers(1, 255, 10)] for _ in range(10)]
    tc = tr.TrainConfig(lr=3e-3, warmup_steps=1, total_steps=10)
    opt = tr.make_optimizer(tc)
    for kind in (eagle.KIND, medusa.KIND):
        seqs = et.make_sequences(cfg, params, prompts, outs, topk=4, batch=4, length_bucket=16,
                                 features=kind.features(cfg))
        draft, dp = kind.init(cfg, params, np.arange(0, 256, 2), seed=1, shared_head=False)
        trainer = head_online.HeadTrainer(draft, tc, opt, 2)
        own = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), heads.trainable_of(draft, dp))
        frozen = {k: v for k, v in dp.items() if k not in own}
        res = {}
        for n in (1, 8):
            pl = hp.Placement(n)
            t, s, f = pl.replicated(own), pl.replicated(opt.init(own)), pl.replicated(frozen)
            for step in range(3):
                batch = et.make_batch(seqs, np.random.default_rng(step), 8, 16)
                t, s, loss, ok = trainer.step(t, s, f, pl.rows(batch))
                assert bool(ok)
            if n == 8:
                assert pl.rows(batch)[0].sharding.spec[0] == "data"
                for a in jax.tree_util.tree_leaves((t, s)):
                    assert len(a.sharding.device_set) == 8 and a.sharding.is_fully_replicated, a.sharding
            res[n] = (jax.device_get(t), float(loss))
        for a, b in zip(jax.tree_util.tree_leaves(res[1][0]), jax.tree_util.tree_leaves(res[8][0])):
            np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-6)
        assert abs(res[1][1] - res[8][1]) < 1e-5 * max(1.0, abs(res[1][1])), (res[1][1], res[8][1])
    print("MESH_STEP_OK")
""")


def test_the_mesh_step_equals_the_single_device_step():
    """Three optimizer steps of an EAGLE and a Medusa head on a data mesh of 8 fake CPU devices
    (the global batch of 8 windows split one per device, the head and its optimizer state
    replicated) give the single-device steps' params and loss (to float rounding: the gradient's
    sum runs in another order)."""
    r = subprocess.run([sys.executable, "-c", _MESH], capture_output=True, text=True, env=dict(os.environ),
                       timeout=600)
    assert "MESH_STEP_OK" in r.stdout, r.stderr[-3000:]


@pytest.mark.slow
def test_the_launch_command_writes_data_trains_stops_on_sigterm_and_resumes(tmp_path):
    """launch/distill.py --pipeline all on the tiny model: the data set, then training; SIGTERM
    mid-run exits 0 with one line; the same command resumes and finishes; mistakes are one-line
    errors (exit 2)."""
    import time

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    inp = tmp_path / "p.jsonl"
    inp.write_text("".join(json.dumps({"prompt": f"row {i} " + "ab" * (i % 5)}) + "\n" for i in range(48)))
    args = [sys.executable, os.path.join(root, "launch", "distill.py"), "--drafter", "eagle", "--model", "tiny-random",
            "--pipeline", "all", "--data_dir", str(tmp_path / "data"), "--prompt_files", str(inp),
            "--checkpoint_dir", str(tmp_path / "ck"), "--max_new_tokens", "16", "--shard_size", "8",
            "--eval_sequences", "8", "--distill_length", "24", "--window_context", "4", "--distill_batch", "4",
            "--epochs", "40", "--draft_vocab", "64", "--log_every", "1", "--eval_every", "20",
            "--engine_eval_every", "0", "--checkpoint_minutes", "0", "--checkpoint_steps", "10",
            "--plot", str(tmp_path / "c.png")]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=env)
    err = []
    for line in p.stderr:
        err.append(line)
        if line.startswith("step 30/"):
            p.send_signal(signal.SIGTERM)
            break
    err += p.stderr.readlines()
    assert p.wait(timeout=300) == 0 and "SIGTERM: stopped after step" in "".join(err), "".join(err)[-3000:]
    t0 = time.time()
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "resumed" in r.stderr and "[trained " in r.stderr, r.stderr[-3000:]
    assert time.time() - t0 < 600 and (tmp_path / "c.png").stat().st_size > 0
    for extra, msg in [(("--distill_batch", "2"), "trains a run of other settings"),
                       (("--data_parallel", "3", "--distill_batch", "4"), "--distill_batch 4 does not split evenly"),
                       (("--input_jsonl", str(inp)), "--pipeline reads --prompt_files")]:
        r = subprocess.run(args + list(extra), capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 2 and msg in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]


def test_the_curve_takes_snapshots_evenly_in_log_tokens_and_counts_steps_per_group():
    """benchmarks/head_curve.py: at most n snapshots, the first and the last kept and the rest
    nearest to even steps in log tokens; tokens per step = 1 + accepted / steps over a group's
    prompts (not a mean of per-prompt ratios), the chat categories pooled."""
    from benchmarks import head_curve as hc

    snaps = [(t, f"s{t}") for t in (10, 20, 40, 80, 160, 320, 640, 1280)]
    assert hc.pick(snaps, 0) == snaps and hc.pick(snaps, 9) == snaps
    assert [t for t, _ in hc.pick(snaps, 4)] == [10, 40, 320, 1280]
    assert [t for t, _ in hc.pick(snaps, 2)] == [10, 1280]
    rows = [(10, 5, True), (30, 0, True), (20, 20, False), (4, 4, True)]
    s = hc.summarize(rows, ["writing", "qa", "math", "gsm8k"])
    assert s["chat"] == 1 + 5 / 40 and s["math"] == 2.0 and s["overall"] == 1 + 29 / 64
    assert (s["identical"], s["prompts"]) == (3, 4)


def test_self_prompts_start_from_the_given_openings(model, tmp_path):
    """--self_prompt_starters: each self-written prompt begins with the opening its seed picks
    and goes on with the model's own text; a data set made without openings keeps its identity
    (no new key); openings need --self_prompts; the shipped file reads, comments skipped."""
    starters = ("Write a poem about", "Explain why", "Pretend you are a")
    writer = hd.TargetWriter(model, batch=4)
    prefix = model.tokenizer.encode("user: ", add_bos=False)
    seeds = [3, 10, 11, 12, 40]
    texts = writer.self_prompts(prefix, seeds, 12, starters=starters)
    assert any(t is not None for t in texts)
    for seed, text in zip(seeds, texts):
        if text is not None:
            start = hd.starter_of(starters, seed)
            assert text.startswith(start) and len(text) > len(start), (seed, text)
    assert len({hd.starter_of(starters, s) for s in seeds}) == 3
    assert "self_prompt_starters" not in hd.DataSettings(self_prompts=4).identity()
    ident = hd.DataSettings(self_prompts=4, self_prompt_starters=starters).identity()
    assert ident["self_prompt_starters"] == list(starters)
    with pytest.raises(SpecjaxError, match="give --self_prompts too"):
        hd.DataSettings(prompt_files=("x.jsonl",), self_prompt_starters=starters).check()
    path = tmp_path / "starters.txt"
    path.write_text("# a comment\n\nWrite a poem about\n  Explain why  \n")
    assert hd.read_starters(str(path)) == ("Write a poem about", "Explain why")
    (tmp_path / "empty.txt").write_text("# nothing\n")
    for bad, msg in ((tmp_path / "empty.txt", "holds no opening"), (tmp_path / "missing.txt", "No such file")):
        with pytest.raises(SpecjaxError, match=msg):
            hd.read_starters(str(bad))
    for name, least in (("chat_starters.txt", 50), ("task_starters.txt", 25)):  # (the shipped openings)
        got = hd.read_starters(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                                            "data", name))
        assert len(got) >= least and len(set(got)) == len(got) and not any(s.startswith("#") for s in got), name


def test_a_run_trains_on_several_data_sets_as_one(model, data, tmp_path):
    """--pipeline train --data_dir A,B: every training shard of both, A's held-out shard, an
    identity of its own (a run on A alone cannot be resumed on A + B); data sets of other
    features are refused in one line."""
    root, st, ds = data
    other = dataclasses.replace(st, seed=5, eval_sequences=2)
    ds2 = hd.build_data(model, str(tmp_path / "second"), other, eagle.KIND.features(model.cfg), log=quiet)
    both = hd.DataSet.union([ds, ds2])
    assert [s.name for s in both.train] == [s.name for s in ds.train + ds2.train] and both.eval is ds.eval
    assert both.digest() not in (ds.digest(), ds2.digest())
    assert both.digest() == hd.DataSet.union([hd.DataSet.open(ds.directory, quiet), ds2]).digest()
    assert hd.DataSet.union([ds]) is ds and both.summary().startswith("2 data sets, ")
    odd = hd.DataSet(ds2.directory, {**ds2.spec, "features": [0]}, ds2.eval, ds2.train)
    with pytest.raises(SpecjaxError, match="differ in features"):
        hd.DataSet.union([ds, odd])
    rc = run_config(tmp_path / "run", epochs=0.5)
    alone, _ = hp.windows(ds.train, rc.window, rc.context, rc.prompt_loss)
    rows, _ = hp.windows(both.train, rc.window, rc.context, rc.prompt_loss)
    assert len(rows) > len(alone)
    got = hp.train(eagle.KIND, model, both, rc, TC, log=quiet)
    assert got["stopped"] is None and got["step"] == got["planned"] >= 1
    assert eagle.read_spec(rc.checkpoint_dir, model.cfg)["training"]["tokens"] == got["tokens"]
    with pytest.raises(SpecjaxError, match="trains a run of other settings"):  # (the data differ)
        hp.train(eagle.KIND, model, ds, rc, TC, log=quiet)


def test_a_new_run_starts_from_a_saved_head(model, data, trained, tmp_path):
    """--init_head: a new run starts from the saved head's own arrays and its draft vocabulary
    (fine-tuning), records it, and refuses a head of other settings in one line."""
    from specjax.drafters import heads

    rc0, _ = trained
    saved = heads.trainable_of(*heads.load_head(eagle.KIND, rc0.checkpoint_dir, model.cfg, model.params))
    rc = run_config(tmp_path / "tuned", init_head=rc0.checkpoint_dir, draft_vocab=0)
    got = hp.train(eagle.KIND, model, data[2], rc, tr.TrainConfig(lr=1e-12), log=quiet, kill_after=1)
    assert got["stopped"] == "killed" and got["step"] == 1
    for k in saved:
        for a, b in zip(_leaves(saved[k]), _leaves(got["trainable"][k])):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a, np.float32), atol=1e-6, err_msg=k)
    pipe = json.loads(open(os.path.join(rc.checkpoint_dir, hp.PIPELINE_FILE)).read())
    assert pipe["vocab_ids"] == heads.read_spec(eagle.KIND, rc0.checkpoint_dir, model.cfg)["vocab_ids"].tolist()
    assert pipe["run"]["init_head"] == os.path.abspath(rc0.checkpoint_dir)
    # a shared head (its vocabulary rows the target's) takes a vocabulary counted again on the
    # run's data: the same trained arrays, new ids, and their rows rebuilt from the target's
    rc32 = run_config(tmp_path / "v", init_head=rc0.checkpoint_dir, draft_vocab=32)
    got = hp.train(eagle.KIND, model, data[2], rc32, tr.TrainConfig(lr=1e-12), log=quiet, kill_after=1)
    ids32 = json.loads(open(os.path.join(rc32.checkpoint_dir, hp.PIPELINE_FILE)).read())["vocab_ids"]
    assert len(set(ids32)) == 32 and got["step"] == 1
    for k in saved:
        for a, b in zip(_leaves(saved[k]), _leaves(got["trainable"][k])):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a, np.float32), atol=1e-6, err_msg=k)
    with pytest.raises(SpecjaxError, match="head of other settings"):
        hp.train(eagle.KIND, model, data[2], run_config(tmp_path / "other", init_head=rc0.checkpoint_dir,
                                                        shared_head=False), TC, log=quiet)
    # a wider MLP (--eagle_mlp_width): the saved head grown into it (eagle.grow), recorded as the run's
    wide = run_config(tmp_path / "wide", init_head=rc0.checkpoint_dir, draft_vocab=0, settings=(("mlp_width", 256),))
    got = hp.train(eagle.KIND, model, data[2], wide, tr.TrainConfig(lr=1e-12), log=quiet, kill_after=1)
    layer, was = got["trainable"]["layer"], saved["layer"]
    np.testing.assert_allclose(np.asarray(layer["w_up"])[:, :128], np.asarray(was["w_up"], np.float32), atol=1e-6)
    np.testing.assert_allclose(np.asarray(layer["w_down"])[128:], 0.0, atol=1e-6)
    pipe = json.loads(open(os.path.join(wide.checkpoint_dir, hp.PIPELINE_FILE)).read())
    assert pipe["settings"] == {"mlp_width": 256, "layers": 1}
    # killed after its first checkpoint (step 3), the grown run resumes from it
    killed = hp.train(eagle.KIND, model, data[2], wide, tr.TrainConfig(lr=1e-12), log=quiet, kill_after=4)
    assert killed["step"] == 4
    lines = []
    again = hp.train(eagle.KIND, model, data[2], wide, tr.TrainConfig(lr=1e-12), log=lines.append, kill_after=1)
    assert again["step"] == 4 and any("resumed" in m for m in lines), lines
    assert np.asarray(again["trainable"]["layer"]["w_down"]).shape == (256, model.cfg.hidden_size)
    # a deeper head (--eagle_layers): the saved one with a layer on top that passes its input through
    deep = run_config(tmp_path / "deep", init_head=rc0.checkpoint_dir, draft_vocab=0, settings=(("layers", 2),))
    got = hp.train(eagle.KIND, model, data[2], deep, tr.TrainConfig(lr=1e-12), log=quiet, kill_after=1)
    np.testing.assert_allclose(np.asarray(got["trainable"]["layer"]["wq"]), np.asarray(was["wq"], np.float32), atol=1e-6)
    np.testing.assert_allclose(np.asarray(got["trainable"]["upper"]["wo"]), 0.0, atol=1e-6)
    assert json.loads(open(os.path.join(deep.checkpoint_dir, hp.PIPELINE_FILE)).read())["settings"]["layers"] == 2


def test_spec_bench_training_prompts_leave_the_measured_ones_out(tmp_path):
    """benchmarks/make_workload.py --spec_bench_train N: every first turn but the first N of each
    category (the ones the benchmarks and head_curve measure) and GSM8K's shared test questions."""
    from benchmarks import make_workload
    from specjax.specbench import load_questions

    (tmp_path / "spec_bench").mkdir()
    (tmp_path / "gsm8k").mkdir()
    lines = [{"question_id": i, "category": c, "turns": [f"{c} question {i}", "a second turn"]}
             for i, c in enumerate(["writing", "math_reasoning"] * 5)]
    (tmp_path / "spec_bench" / "question.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "gsm8k" / "test_shared_200.jsonl").write_text(json.dumps({"question": "math_reasoning question 9 "}) + "\n")
    rows = make_workload.spec_bench_train(str(tmp_path), 2)
    measured, _ = load_questions(str(tmp_path / "spec_bench" / "question.jsonl"), None, 2)
    assert [r["question_id"] for r in rows] == [4, 6, 8, 5, 7]  # (by category; 9 is a GSM8K test question)
    assert not {r["prompt"] for r in rows} & {q["text"] for q in measured}
    assert all(r["prompt"] == f"{r['category']} question {r['question_id']}" for r in rows)
    assert len(make_workload.spec_bench_train(str(tmp_path), 0)) == 9



def test_shard_estimate_of_a_saved_head_is_the_runs_held_out_estimate(model, data, trained):
    """head_pipeline.shard_estimate (benchmarks/head_fit.py): the saved head, loaded as served, on
    the held-out shard gives the run's last recorded held-out estimate; on a training shard, an
    estimate of the same form (top-1 in [0, 1], tokens per step in [1, k + 1])."""
    from specjax.drafters import heads

    rc, got = trained
    spec = eagle.read_spec(rc.checkpoint_dir, model.cfg)
    held = spec["training"]["heldout"]
    assert held["step"] == got["step"]
    draft, dparams = heads.load_head(eagle.KIND, rc.checkpoint_dir, model.cfg, model.params)
    top1, est = hp.shard_estimate(eagle.KIND, draft, dparams, data[2].eval, rc)
    assert (top1, est) == pytest.approx((held["top1"], held["estimate"]), abs=1e-6)
    top1, est = hp.shard_estimate(eagle.KIND, draft, dparams, data[2].train[0], rc)
    assert 0.0 <= top1 <= 1.0 and 1.0 <= est <= rc.k + 1
