"""Training data for feature heads at scale (``distill.head_pipeline``; ``launch/distill.py
--pipeline data``): prompts, the target's answers written through the serving engine, and the
target's features and top-k teacher at every position, in verified shards on disk. No downloads.

Prompts come from JSONL files given by path (a ``prompt``, ``question`` (GSM8K), ``instruction``
or ``text`` field, or Spec-Bench's first ``turns``; ``path:field`` names another) and from the
instruct model itself: its chat template up to the user's text, which it continues at T = 1
(Magpie), from nothing or from openings given in a file (``--self_prompt_starters``: "Write a
poem about", "Explain why": the kinds of request a small model rarely thinks of writing itself).
They are deduplicated (case- and whitespace-folded text) and their diversity is reported as the
distinct-2-gram ratio of their tokens (distinct token bigrams / all bigrams).

Every prompt is answered ``answers_per_prompt`` times by ``TargetWriter``: the engine's batch
path (``generate.Generator``: continuous admission into batch buckets up to ``gen_batch`` rows),
each request with its own SamplingParams (a temperature from ``temperatures``, cycling: greedy
and sampled answers; a seed of its own). Then ONE teacher-forced target forward per sequence
(``eagle_train.make_sequences``) gives the head's features and the target's top-k logits at every
position of the prompt and the answer. (The generation's own steps compute the same features
and logits and could supply them; they do not yet, so every answer costs one prefill-speed
forward more.)

Storage (``DataSet``): ``data.json`` (what the data set is: the target, the features kept, every
setting, the prompt files' digests) and shards ``eval-00000`` (held-out, greedy answers to prompts
no training shard has) and ``train-00000``..: per shard a ``.bin`` of arrays end to end (tokens
int32, features bfloat16, top-k ids int32, top-k logits bfloat16, ...; ``ondisk.write_mapped``,
mapped back without a copy) and a ``.json`` descriptor written after it (``ondisk.write``: the
shard is complete once it exists). Both are verified on read; a shard that does not verify is
one warning and is generated again (``build_data``) or refused (``DataSet.open``), never used.
Each shard's content is a function of the settings and its index (its prompts, seeds and
temperatures come from a plan computed from them), so a killed generation restarts at the first
missing shard, and a damaged one is regenerated alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from typing import Callable, Sequence

import numpy as np

from specjax import ondisk
from specjax.errors import SpecjaxError, require

PROMPT_FIELDS = ("prompt", "question", "instruction", "text")  # the first a line has (else Spec-Bench's turns)
DATA_FILE = "data.json"
EVAL_SHARD = "eval-00000"
BF16 = "bfloat16"
SEED_MOD = 2**31 - 1
# Draft vocabularies the coverage table measures (plus the full one), and the default choice: the
# smallest whose coverage of held-out target top-1 tokens reaches COVERAGE_TARGET. A draft can be
# accepted only where the target's token is in its vocabulary, so coverage caps acceptance; every
# draft forward reads the head's vocabulary rows, so rows past that cap cost time for tokens a
# draft rarely gets right.
VOCAB_SIZES = (4096, 8192, 16384)
COVERAGE_TARGET = 0.95


def say(msg: str) -> None:
    print(msg, file=sys.stderr)


# ---------------------------------------------------------------------------------------- prompts


def read_prompt_file(spec: str) -> list[str]:
    """The prompt texts of a JSONL file ``spec`` (``path`` or ``path:field``), in order (blank
    lines skipped; a line without a usable text: a one-line SpecjaxError naming it)."""
    path, field = spec, None
    head, sep, tail = spec.rpartition(":")
    if sep and head and tail and os.sep not in tail and not os.path.exists(spec):
        path, field = head, tail
    if not os.path.isfile(path):
        raise SpecjaxError(f"prompt file {path} does not exist")
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise SpecjaxError(f"{path}:{i}: not JSON ({e})".splitlines()[0]) from None
            text = None
            if isinstance(rec, dict):
                if field:
                    text = rec.get(field)
                else:
                    text = next((rec[k] for k in PROMPT_FIELDS if isinstance(rec.get(k), str)), None)
                    turns = rec.get("turns")
                    if text is None and isinstance(turns, list) and turns and isinstance(turns[0], str):
                        text = turns[0]
            if not isinstance(text, str):
                want = repr(field) if field else " / ".join(PROMPT_FIELDS) + " / turns"
                raise SpecjaxError(f"{path}:{i}: no text field {want}")
            if text.strip():
                out.append(text)
    return out


def text_key(text: str) -> str:
    """What two prompts that differ only in case and whitespace share (the dedup key)."""
    return hashlib.sha256(" ".join(text.lower().split()).encode()).hexdigest()[:16]


def dedup(texts: Sequence[str], seen: set | None = None) -> list[str]:
    """``texts`` without repeats (``text_key``) and without those whose key is in ``seen`` (which
    gains the kept ones' keys), in order."""
    seen = set() if seen is None else seen
    out = []
    for t in texts:
        k = text_key(t)
        if k not in seen:
            seen.add(k)
            out.append(t)
    return out


def distinct_ngrams(seqs: Sequence[Sequence[int]], n: int = 2) -> float:
    """Distinct n-grams / all n-grams over token sequences (1.0: no n-gram repeats; a set of
    near-copies scores low)."""
    grams, total = set(), 0
    for s in seqs:
        s = tuple(int(t) for t in s)
        total += max(len(s) - n + 1, 0)
        grams.update(s[i:i + n] for i in range(len(s) - n + 1))
    return len(grams) / max(total, 1)


def user_prefix(tokenizer, system: str | None) -> list[int]:
    """The chat template up to the user's text (what the model continues to write a prompt)."""
    marker = "\x00"
    text = tokenizer.apply_chat_template(([{"role": "system", "content": system}] if system else []) +
                                         [{"role": "user", "content": marker}])
    if marker not in text:
        raise SpecjaxError("--self_prompts: this chat template does not show the user's text, so it has no "
                           "user prefix to write prompts from")
    return tokenizer.encode(text[:text.index(marker)], add_bos=False)


class TargetWriter:
    """The target writing text through the serving engine: a ``generate.Generator`` (the engine's
    K = 0 path, requests admitted as rows free up) over batch buckets up to ``batch`` rows, with
    the forward options ``fwd`` (a launch script's resolved ones: the rows kernel where it pays).
    The prefix store is off: a prompt is then prefilled the same way whatever was written before
    it, so a shard written again is the same shard."""

    def __init__(self, model, batch: int = 32, fwd=None):
        from specjax.generate import Generator
        from specjax.models.options import ForwardOptions

        require(1 <= batch <= 256, f"the engine's generation batch must be 1..256 rows, got {batch}")
        fwd = fwd or ForwardOptions()
        buckets = tuple(sorted({min(2 ** i, batch) for i in range(9)}))
        self.model, self.batch = model, batch
        self.gen = Generator(model.cfg, model.params_for(fwd), eos_ids=model.tokenizer.eos_ids, batch_buckets=buckets,
                             fwd=fwd, prefix_cache_mb=0)

    def write(self, prompts: Sequence[Sequence[int]], temperatures: Sequence[float], seeds: Sequence[int],
              max_new_tokens: int, progress: Callable[[int], None] | None = None, chunk: int = 0) -> list[list[int]]:
        """Each prompt's continuation (up to ``max_new_tokens`` or an end-of-sequence id), greedy
        at temperature 0, else sampled with its seed. ``chunk``: prompts per engine run (0: all in
        one; smaller ones report ``progress`` more often but idle rows at each run's end)."""
        from specjax.sampling import SamplingParams

        samp = [SamplingParams(temperature=float(t), seed=int(s) % SEED_MOD) for t, s in zip(temperatures, seeds)]
        n = chunk or max(len(prompts), 1)
        out: list[list[int]] = []
        for i in range(0, len(prompts), n):
            got = self.gen.generate([list(p) for p in prompts[i:i + n]], samp[i:i + n], max_new_tokens=max_new_tokens)
            out += [list(r.tokens) for r in got]
            if progress:
                progress(len(got))
        return out

    def self_prompts(self, prefix: Sequence[int], seeds: Sequence[int], max_tokens: int,
                     progress: Callable[[int], None] | None = None, chunk: int = 0,
                     starters: Sequence[str] = ()) -> list[str | None]:
        """One prompt text per seed, written by the model from its chat template's user prefix at
        T = 1 (None where it wrote fewer than 8 characters of its own). ``starters``: the model
        continues one of these openings (``starter_of(seed)``) after the prefix instead of
        starting from nothing, and the text begins with it."""
        tok = self.model.tokenizer
        opening = [tok.encode(starter_of(starters, s), add_bos=False) if starters else [] for s in seeds]
        outs = self.write([list(prefix) + o for o in opening], [1.0] * len(seeds), seeds, max_tokens, progress, chunk)
        outs = [[t for t in out if t not in tok.eos_ids] for out in outs]
        return [tok.decode(o + out).strip() if len(tok.decode(out).strip()) >= 8 else None
                for o, out in zip(opening, outs)]


def starter_of(starters: Sequence[str], seed: int) -> str:
    """The opening a self-written prompt with this seed starts from (the slots' seeds spread
    over the list)."""
    return starters[seed % len(starters)]


def read_starters(path: str) -> tuple[str, ...]:
    """``--self_prompt_starters``: one opening per line (blank lines and ``#`` comments skipped);
    a file that cannot be read or holds none: a one-line SpecjaxError."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
    except OSError as e:
        raise SpecjaxError(f"--self_prompt_starters {path}: {e.strerror or e}") from None
    got = tuple(line for line in lines if line and not line.startswith("#"))
    require(got, f"--self_prompt_starters {path} holds no opening (one a line)")
    return got


# ----------------------------------------------------------------------------------------- shards

_FIELDS = ("tokens", "bounds", "starts", "temps", "feats", "ids", "logits")


@dataclasses.dataclass
class Shard:
    """One shard's arrays (views of the verified mapped file): ``tokens`` [N] (every sequence end
    to end, sequence i at ``bounds[i]:bounds[i + 1]``), ``starts`` [n] (the prompt's length - 1),
    ``temps`` [n] (the answer's sampling temperature), ``feats`` [N, F] bfloat16, top-k ``ids``
    [N, k] int32 and ``logits`` [N, k] bfloat16; ``meta``: its descriptor."""

    name: str
    tokens: np.ndarray
    bounds: np.ndarray
    starts: np.ndarray
    temps: np.ndarray
    feats: np.ndarray
    ids: np.ndarray
    logits: np.ndarray
    meta: dict

    def __len__(self) -> int:
        return len(self.starts)

    def sequence(self, i: int):
        """Sequence i as an ``eagle_train.HeadSequence`` of views (nothing copied)."""
        from specjax.distill.eagle_train import HeadSequence

        a, b = int(self.bounds[i]), int(self.bounds[i + 1])
        return HeadSequence(self.tokens[a:b], int(self.starts[i]), self.feats[a:b], self.ids[a:b], self.logits[a:b])

    def lengths(self) -> np.ndarray:
        return np.diff(self.bounds)

    def prompt(self, i: int) -> list[int]:
        return self.tokens[int(self.bounds[i]):int(self.bounds[i]) + int(self.starts[i]) + 1].tolist()


def _paths(directory: str, name: str) -> tuple[str, str]:
    return os.path.join(directory, name + ".bin"), os.path.join(directory, name + ".json")


def write_shard(directory: str, name: str, seqs, temps: Sequence[float], meta: dict) -> dict:
    """Write sequences (``eagle_train.HeadSequence``) as shard ``name``: the arrays, then the
    descriptor (``meta`` plus the arrays' places); returns the descriptor. A disk that refuses is
    a one-line SpecjaxError (a data set without its shards is no data set)."""
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    lens = np.asarray([len(s.tokens) for s in seqs], np.int64)
    arrays = {"tokens": np.concatenate([np.asarray(s.tokens, np.int32) for s in seqs]),
              "bounds": np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
              "starts": np.asarray([s.start for s in seqs], np.int32),
              "temps": np.asarray(temps, np.float32),
              "feats": np.concatenate([np.asarray(s.feats).astype(bf16) for s in seqs]),
              "ids": np.concatenate([np.asarray(s.ids, np.int32) for s in seqs]),
              "logits": np.concatenate([np.asarray(s.logits).astype(bf16) for s in seqs])}
    raw = [np.ascontiguousarray(arrays[f]).view(np.uint16) if arrays[f].dtype == bf16 else arrays[f] for f in _FIELDS]
    bin_path, json_path = _paths(directory, name)
    offsets = ondisk.write_mapped(bin_path, raw)
    desc = dict(meta, name=name, sequences=len(seqs), tokens=int(lens.sum()),
                bytes=int(offsets[-1] + raw[-1].nbytes) if offsets is not None else 0,
                arrays={f: [int(o), BF16 if arrays[f].dtype == bf16 else arrays[f].dtype.name, list(arrays[f].shape)]
                        for f, o in zip(_FIELDS, offsets or [0] * len(_FIELDS))})
    if offsets is None or not ondisk.write(json_path, json.dumps(desc).encode()):
        raise SpecjaxError(f"cannot write shard {name} to {directory}")
    return desc


def read_descriptor(directory: str, name: str) -> dict | None:
    """Shard ``name``'s descriptor if it is there and verifies (the shard was finished)."""
    blob = ondisk.read(_paths(directory, name)[1])
    if blob is None:
        return None
    try:
        return json.loads(blob)
    except ValueError:
        return None


def read_shard(directory: str, name: str) -> Shard | None:
    """Shard ``name``, mapped and verified; None when it is missing or unfinished, or when it does
    not match its record (one warning, from ``ondisk``)."""
    import ml_dtypes

    desc = read_descriptor(directory, name)  # (one that does not verify: ondisk's one warning)
    if desc is None:
        return None
    data = ondisk.mapped(_paths(directory, name)[0])
    if data is None or len(data) != desc.get("bytes"):
        return None
    views = {}
    for f in _FIELDS:
        off, dt, shape = desc["arrays"][f]
        dtype = np.dtype(ml_dtypes.bfloat16) if dt == BF16 else np.dtype(dt)
        views[f] = np.ndarray(tuple(shape), dtype, buffer=data, offset=off)
    return Shard(name, meta=desc, **views)


# --------------------------------------------------------------------------------------- data set


@dataclasses.dataclass(frozen=True)
class DataSettings:
    """What a data set is made from (each a launch/distill.py flag of the same name, whose help
    says what it does). ``gen_batch`` changes only the speed (and float rounding), not the set."""

    prompt_files: tuple[str, ...] = ()
    self_prompts: int = 0
    self_prompt_tokens: int = 48
    answers_per_prompt: int = 1
    temperatures: tuple[float, ...] = (0.0, 0.7, 1.0)
    max_new_tokens: int = 256
    max_prompt: int = 384
    chat: bool = True
    system: str | None = None
    topk: int = 8
    eval_sequences: int = 64
    shard_size: int = 128
    seed: int = 0
    texts_from: str | None = None
    gen_batch: int = 32
    self_prompt_starters: tuple[str, ...] = ()

    def check(self) -> None:
        """A one-line SpecjaxError for settings that cannot make a data set."""
        require(self.prompt_files or self.self_prompts or self.texts_from,
                "--pipeline needs prompts: --prompt_files and/or --self_prompts (or --data_texts_from)")
        require(not self.self_prompts or self.chat, "--self_prompts writes prompts from the chat template: it "
                "needs --chat")
        require(self.self_prompts or not self.self_prompt_starters, "--self_prompt_starters opens self-written "
                "prompts: give --self_prompts too")
        require(self.temperatures and all(t == 0 or 0.05 <= t <= 2 for t in self.temperatures),
                f"--temperatures: 0 (greedy) or 0.05..2, got {list(self.temperatures)}")
        for name, lo in (("answers_per_prompt", 1), ("max_new_tokens", 1), ("max_prompt", 1), ("topk", 1),
                         ("eval_sequences", 1), ("shard_size", 1), ("self_prompt_tokens", 1), ("gen_batch", 1)):
            require(getattr(self, name) >= lo, f"--{name} must be >= {lo}, got {getattr(self, name)}")

    def identity(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("gen_batch")
        if not self.self_prompt_starters:  # (absent, as in the data sets made before it existed)
            d.pop("self_prompt_starters")
        else:
            d["self_prompt_starters"] = list(self.self_prompt_starters)
        d["prompt_files"] = [[os.path.abspath(f), _digest(f.rpartition(":")[0] if not os.path.exists(f) else f)]
                             for f in self.prompt_files]
        d["temperatures"] = list(self.temperatures)
        d["texts_from"] = os.path.abspath(self.texts_from) if self.texts_from else None
        return d


def differ(a: dict, b: dict) -> list[str]:
    """The keys whose values differ between two records (what a refused resume names)."""
    return [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def _digest(path: str) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError:
        return "missing"
    return h.hexdigest()[:16]


@dataclasses.dataclass
class Slot:
    """One sequence a shard holds: a prompt (a file prompt's text, or None: the model writes
    one with ``seed``), the answer's temperature and seed."""

    text: str | None
    temperature: float
    seed: int


def _plan(st: DataSettings, texts: list[str]) -> tuple[list[Slot], list[list[Slot]]]:
    """(the held-out slots, the training shards' slots) of these settings and deduplicated file
    prompts: the held-out prompts are the first ``eval_sequences`` of a seeded shuffle (or
    self-written ones without files), answered greedily (its agreement estimate is exact on
    greedy text); the training slots (every other prompt ``answers_per_prompt`` times, the
    temperatures cycling, then the self-written ones) are shuffled with the seed and cut into
    shards."""
    rng = np.random.default_rng([st.seed, 1])
    order = [texts[i] for i in rng.permutation(len(texts))]
    n_eval = min(st.eval_sequences, len(order) // 2) if order else st.eval_sequences
    base = st.seed * 1_000_003

    def seed_of(i: int) -> int:
        return (base + 7919 * i) % SEED_MOD

    held = [Slot(t, 0.0, seed_of(i)) for i, t in enumerate(order[:n_eval])] if order else \
        [Slot(None, 0.0, seed_of(10**8 + i)) for i in range(n_eval)]
    slots = [Slot(t, 0.0, 0) for t in order[n_eval:] for _ in range(st.answers_per_prompt)]
    slots += [Slot(None, 0.0, 0) for _ in range(st.self_prompts)]
    temps = st.temperatures
    for i, s in enumerate(slots):
        s.temperature, s.seed = float(temps[i % len(temps)]), seed_of(i + 1)
    slots = [slots[i] for i in np.random.default_rng([st.seed, 2]).permutation(len(slots))]
    return held, [slots[i:i + st.shard_size] for i in range(0, len(slots), st.shard_size)]


class DataSet:
    """A data set on disk, opened for training: its ``spec`` (``data.json``), the held-out shard
    ``eval`` and the training shards ``train`` (each verified when opened)."""

    def __init__(self, directory: str, spec: dict, eval_shard: Shard, train: list[Shard], parts: tuple = ()):
        self.directory, self.spec, self.eval, self.train = directory, spec, eval_shard, train
        self.parts = parts  # (the data sets a union is made of)

    @staticmethod
    def union(sets: Sequence["DataSet"]) -> "DataSet":
        """Several data sets trained on as one (``--pipeline train --data_dir A,B``): every
        training shard of each, in order, and the first one's held-out shard (so a run's held-out
        numbers stay comparable with a run on the first alone). They must be of one target and
        keep the same features: a one-line SpecjaxError otherwise."""
        first = sets[0]
        if len(sets) == 1:
            return first
        for d in sets[1:]:
            for key in ("target", "vocab_size", "features"):
                require(d.spec.get(key) == first.spec.get(key), f"{d.directory} and {first.directory} differ in "
                        f"{key} ({d.spec.get(key)} vs {first.spec.get(key)}): one run trains on data sets of one "
                        "target with the same features")
        return DataSet("+".join(d.directory for d in sets), first.spec, first.eval, [s for d in sets for s in d.train],
                       parts=tuple(sets))

    @staticmethod
    def open(directory: str, log: Callable[[str], None] = say) -> "DataSet":
        """The data set in ``directory``; a missing ``data.json``, held-out shard or every
        training shard: a one-line SpecjaxError. Training shards missing or damaged are one line
        and left out (a run resumed on another set of shards is refused by its record)."""
        spec = read_spec(directory)
        ev = read_shard(directory, EVAL_SHARD)
        if ev is None:
            raise SpecjaxError(f"{directory} has no intact held-out shard ({EVAL_SHARD}): run --pipeline data "
                               "with the same settings to write it")
        names = [f"train-{i:05d}" for i in range(spec["train_shards"])]
        train = [s for s in (read_shard(directory, n) for n in names) if s is not None]
        if not train:
            raise SpecjaxError(f"{directory} has no intact training shard: run --pipeline data with the same "
                               "settings to write them")
        if len(train) < len(names):
            got = {s.name for s in train}
            log(f"[{len(names) - len(train)} of {len(names)} training shards missing or damaged, left out: "
                f"{', '.join(n for n in names if n not in got)[:200]} (--pipeline data writes them again)]")
        return DataSet(directory, spec, ev, train)

    @property
    def features(self) -> tuple[int, ...]:
        return tuple(self.spec["features"])

    def digest(self) -> str:
        """The training shards' identity (their contents' records: a shard written again is the
        same shard): what a resumed run must train on."""
        if self.parts:
            return hashlib.sha256("+".join(d.digest() for d in self.parts).encode()).hexdigest()[:16]
        h = hashlib.sha256(json.dumps(self.spec, sort_keys=True).encode())
        for s in self.train:
            with open(_paths(self.directory, s.name)[0] + ondisk.RECORD, "rb") as f:
                h.update(s.name.encode() + f.read())
        return h.hexdigest()[:16]

    def summary(self) -> str:
        n = sum(len(s) for s in self.train)
        toks = sum(len(s.tokens) for s in self.train)
        answer = sum(int((s.lengths() - s.starts - 1).sum()) for s in self.train)
        gb = sum(s.meta["bytes"] for s in self.train + [self.eval]) / 1e9
        sets = f"{len(self.parts)} data sets, " if self.parts else ""
        return (f"{sets}{len(self.train)} training shards: {n:,} sequences, {toks:,} tokens ({answer:,} written by "
                f"the target), held out {len(self.eval)} sequences; {gb:.2f} GB")


def read_spec(directory: str) -> dict:
    blob = ondisk.read(os.path.join(directory, DATA_FILE))
    if blob is None:
        raise SpecjaxError(f"{directory} holds no head training data ({DATA_FILE} is missing or damaged): "
                           "make it with --pipeline data")
    try:
        return json.loads(blob)
    except ValueError as e:
        raise SpecjaxError(f"{directory}/{DATA_FILE} cannot be read: {e}".splitlines()[0]) from None


def _sequences(model, prompts, outputs, topk: int, features) -> list:
    """Features and teacher of (prompt, output) pairs: ``make_sequences`` in order of length (less
    padding per batch), returned in the given order."""
    from specjax.distill import eagle_train as et

    order = np.argsort([len(p) + len(o) for p, o in zip(prompts, outputs)], kind="stable")
    got = et.make_sequences(model.cfg, model.params, [prompts[i] for i in order], [outputs[i] for i in order],
                            topk=topk, batch=8, features=features)
    out = [None] * len(got)
    for j, i in enumerate(order):
        out[i] = got[j]
    return out


def build_data(model, directory: str, st: DataSettings, features: Sequence[int], fwd=None,
               log: Callable[[str], None] = say) -> DataSet:
    """Write (or finish) the data set of ``st`` in ``directory`` for the target ``model`` keeping
    the target features ``features`` (a head kind's), as the module docstring says; returns it
    opened. A directory holding a data set of other settings: a one-line SpecjaxError."""
    from tqdm import tqdm

    from specjax.distill.offline import prompt_encoder

    st.check()
    cfg, tok = model.cfg, model.tokenizer
    encode = prompt_encoder(model, st.chat, st.system, st.max_prompt, st.max_new_tokens)
    source = None
    if st.texts_from:
        source = read_spec(st.texts_from)
        if source["target"] != cfg.name:
            raise SpecjaxError(f"--data_texts_from {st.texts_from} holds {source['target']}'s text, not {cfg.name}'s")
    texts: list[str] = []
    for f in st.prompt_files:
        texts += read_prompt_file(f)
    n_read = len(texts)
    texts = dedup(texts)
    spec = {"version": 1, "target": cfg.name, "vocab_size": cfg.vocab_size, "features": [int(x) for x in features],
            "settings": st.identity()}
    held, shards = _plan(st, texts)
    if source is not None:  # (another data set's text: its shards, features recomputed)
        spec["train_shards"] = source["train_shards"]
    else:
        spec["train_shards"] = len(shards)
    os.makedirs(directory, exist_ok=True)
    have = ondisk.read(os.path.join(directory, DATA_FILE))
    if have is not None:
        old = json.loads(have)
        diff = differ(old, spec) + [f"settings.{k}" for k in differ(old.get("settings", {}), spec["settings"])]
        if diff:
            raise SpecjaxError(f"{directory} holds a data set made otherwise ({', '.join(diff[:4])} differ): give the "
                               "same settings to go on with it, or a new --data_dir")
    elif not ondisk.write(os.path.join(directory, DATA_FILE), json.dumps(spec, sort_keys=True).encode()):
        raise SpecjaxError(f"cannot write {directory}/{DATA_FILE}")
    if st.prompt_files:
        enc = [encode(t) for t in texts[:2000]]
        log(f"[prompts: {n_read:,} read from {len(st.prompt_files)} file(s), {n_read - len(texts):,} duplicates "
            f"dropped, {len(texts):,} distinct; distinct-2-gram ratio {distinct_ngrams(enc):.3f}"
            f"{' (first 2,000)' if len(texts) > 2000 else ''}; {len(held)} held out]")
    names = [EVAL_SHARD] + [f"train-{i:05d}" for i in range(spec["train_shards"])]
    todo = [n for n in names if read_shard(directory, n) is None]
    if not todo:
        ds = DataSet.open(directory, log)
        log(f"[data set {directory} complete: {ds.summary()}]")
        return ds
    writer = TargetWriter(model, st.gen_batch, fwd) if source is None else None
    prefix = user_prefix(tok, st.system) if (st.self_prompts or not texts) and source is None else None
    t0, written = time.perf_counter(), 0
    with tqdm(total=len(names), initial=len(names) - len(todo), desc="data shards", unit="shard", disable=None) as bar:
        for name in todo:
            t1 = time.perf_counter()
            i = -1 if name == EVAL_SHARD else int(name.split("-")[1])
            if source is not None:
                src = read_shard(st.texts_from, name)
                if src is None:
                    raise SpecjaxError(f"--data_texts_from {st.texts_from}: shard {name} is missing or damaged")
                pairs = [(src.prompt(j), src.sequence(j).tokens[src.starts[j] + 1:].tolist()) for j in range(len(src))]
                temps, keys, n_self = src.temps.tolist(), src.meta.get("prompt_keys", []), 0
            else:
                slots = held if i < 0 else shards[i]
                seen = {text_key(t) for t in texts}
                for n in names[:i + 1]:  # (self-written prompts the earlier shards hold, held-out first)
                    seen.update((read_descriptor(directory, n) or {}).get("prompt_keys", []))
                need = [s for s in slots if s.text is None]
                mine = {id(s) for s in need}
                if need:
                    wrote = writer.self_prompts(prefix, [s.seed + 1 for s in need], st.self_prompt_tokens,
                                                starters=st.self_prompt_starters)
                    for s, t in zip(need, wrote):
                        s.text = t if t is not None and text_key(t) not in seen else None
                        if s.text is not None:
                            seen.add(text_key(s.text))
                    slots = [s for s in slots if s.text is not None]
                n_self = len(need)
                prompts = [encode(s.text) for s in slots]
                answers = writer.write(prompts, [s.temperature for s in slots], [s.seed for s in slots],
                                       st.max_new_tokens)
                pairs, temps = list(zip(prompts, answers)), [s.temperature for s in slots]
                keys = [text_key(s.text) for s in slots if id(s) in mine]
            if not pairs:
                raise SpecjaxError(f"shard {name} would hold no sequence (every self-written prompt was empty or a "
                                   "duplicate)")
            gen_s = time.perf_counter() - t1
            seqs = _sequences(model, [p for p, _ in pairs], [a for _, a in pairs], st.topk, tuple(features))
            for path in _paths(directory, name)[1:]:  # (a kill while rewriting it leaves no old descriptor)
                for f in (path, path + ondisk.RECORD):
                    if os.path.exists(f):
                        os.unlink(f)
            desc = write_shard(directory, name, seqs, temps, {"prompt_keys": keys, "seconds": time.perf_counter() - t1})
            answer = sum(len(a) for _, a in pairs)
            written += answer
            bar.update(1)
            wrote = (f"{answer:,} answer tokens from {st.texts_from}" if source is not None else
                     f"{answer:,} answer tokens written in {gen_s:.0f} s ({answer / max(gen_s, 1e-9):.0f}/s)")
            bar.write(f"[{name}: {desc['sequences']} sequences ({n_self - (len(keys) if n_self else 0)} self-written "
                      f"prompts dropped as duplicates or empty), {desc['tokens']:,} tokens, {wrote}, features "
                      f"{time.perf_counter() - t1 - gen_s:.0f} s; prompts' distinct-2-gram ratio "
                      f"{distinct_ngrams([p for p, _ in pairs]):.3f}]", file=sys.stderr)
    ds = DataSet.open(directory, log)
    log(f"[data set {directory}: {ds.summary()}; this run wrote {written:,} answer tokens in "
        f"{time.perf_counter() - t0:.0f} s]")
    return ds


# --------------------------------------------------------------------------------- the vocabulary


def vocab_table(ds: DataSet, vocab_size: int, keep: Sequence[int],
                cost: Callable[[int], tuple[float, float]], sizes: Sequence[int] = VOCAB_SIZES) -> list[dict]:
    """The draft vocabularies of ``sizes`` (and the full one): each the tokens the target ranks in
    its top-k most often on the training shards (``frequent_tokens``, ``keep`` always in), its
    coverage of the target's top-1 token at the held-out answer positions, and ``cost(n)``: the
    MB of vocabulary rows and of the whole head a draft forward reads with n rows."""
    from specjax.drafters.device import frequent_tokens

    ev = ds.eval
    top1 = np.concatenate([ev.ids[int(ev.bounds[i]) + int(ev.starts[i]):int(ev.bounds[i + 1]), 0]
                           for i in range(len(ev))])
    rows = []
    for n in sorted({s for s in sizes if s < vocab_size} | {vocab_size}):
        ids = frequent_tokens([s.ids for s in ds.train], vocab_size, n, keep=keep) if n < vocab_size \
            else np.arange(vocab_size, dtype=np.int32)
        lm_mb, mb = cost(n)
        rows.append({"size": n, "ids": ids, "coverage": float(np.isin(top1, ids).mean()) if top1.size else 0.0,
                     "lm_head_mb": lm_mb, "mb": mb})
    return rows


def choose_vocab(rows: list[dict]) -> dict:
    """The smallest measured vocabulary whose coverage reaches COVERAGE_TARGET (else the full)."""
    return next((r for r in rows if r["coverage"] >= COVERAGE_TARGET), rows[-1])


def format_vocab_table(rows: list[dict], chosen: int | None = None) -> str:
    lines = ["draft vocab | held-out top-1 coverage | lm_head MB | head MB read per draft forward"]
    for r in rows:
        mark = "  <- chosen" if r["size"] == chosen else ""
        lines.append(f"{r['size']:>11,} | {r['coverage']:>23.4f} | {r['lm_head_mb']:>10.1f} | {r['mb']:>9.1f}{mark}")
    return "\n".join(lines)
