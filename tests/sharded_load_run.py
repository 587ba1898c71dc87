"""Run in a subprocess by test_sharding.py on 8 fake CPU devices: a sharded safetensors checkpoint
(index file, several files) loaded straight into the shards of two meshes equals the params,
each device having read only its slice; a missing or misshapen tensor is a one-line error naming
the config and the mesh. Argument: a scratch directory. Prints LOAD_OK at the end."""
import os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
import json
import sys

import jax
import numpy as np

from specjax import sharding as sh
from specjax.config import get_model_config
from specjax.errors import SpecjaxError
from specjax.models import llama, weights

tmp = sys.argv[1]
cfg = get_model_config("tiny-random").replace(name="tiny-st")
params = llama.init_random_params(cfg, 3)
good = os.path.join(tmp, "good")
weights.save_safetensors_params(params, cfg, good, shards=3)
assert len([f for f in os.listdir(good) if f.endswith(".safetensors")]) == 3

reads = []
real_array = weights.SafetensorsIndex.array
def counting(self, name):
    a = real_array(self, name)
    class Probe:  # records how many elements each device's read touched
        ndim, shape = a.ndim, a.shape
        def __getitem__(self, idx):
            part = a[idx]
            reads.append((name, part.size, a.size))
            return part
    return Probe()
weights.SafetensorsIndex.array = counting

for data, model in ((2, 4), (1, 2)):
    lay = sh.Layout(sh.make_mesh(data, model))
    reads.clear()
    got = weights.load_safetensors_sharded(good, cfg, lay, dtype=np.float32)
    want = lay.put_params(cfg, params)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (path, a.sharding, b.sharding)
    # a tensor split over the model axis is read a slice at a time, never whole
    up = [(n, part, size) for n, part, size in reads if n == "model.layers.0.mlp.up_proj.weight"]
    assert up and all(part == size // model for _, part, size in up), up
weights.SafetensorsIndex.array = real_array

lay = sh.Layout(sh.make_mesh(2, 4))
idx_path = os.path.join(good, "model.safetensors.index.json")
index = json.load(open(idx_path))
for what, edit, needle in [
    ("lacks", lambda wm: wm.pop("model.layers.2.self_attn.k_proj.weight"),
     "tiny-st on mesh data=2 x model=4: the checkpoint in"),
    ("shape", None, "tiny-st on mesh data=2 x model=4: tensor 'model.layers.1.mlp.down_proj.weight' has shape (64, 64)"),
]:
    bad = os.path.join(tmp, what)
    if edit is not None:
        os.makedirs(bad)
        for f in os.listdir(good):
            os.symlink(os.path.join(good, f), os.path.join(bad, f))
        os.unlink(os.path.join(bad, "model.safetensors.index.json"))
        wm = dict(index["weight_map"])
        edit(wm)
        json.dump({"weight_map": wm}, open(os.path.join(bad, "model.safetensors.index.json"), "w"))
    else:
        p2 = dict(params, layers=[dict(lp) for lp in params["layers"]])
        p2["layers"][1]["w_down"] = p2["layers"][1]["w_down"][:64]
        weights.save_safetensors_params(p2, cfg, bad, shards=2)
    try:
        weights.load_safetensors_sharded(bad, cfg, lay)
        raise SystemExit(f"no error: {what}")
    except SpecjaxError as e:
        assert needle in str(e) and "\n" not in str(e), str(e)
print("LOAD_OK")
