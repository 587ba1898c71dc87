"""A fake model for testing the JSONL job layer (specjax.jobs) without JAX, and a command-line
driver over it for kill-and-resume runs in a subprocess.

Generation is a pure function of the record (like greedy decoding), so a resumed job must end
with exactly the output of an uninterrupted one. Prompts containing marker words inject
failures: a batch holding a FAIL-ONCE prompt not seen before in this process raises (a transient
device error), FAIL-ALWAYS always raises when its turn comes, REJECT makes the "engine" report an error for that record.

  python tests/fake_job.py IN OUT [--batch N] [--sleep S]
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specjax.errors import SpecjaxError  # noqa: E402

DEFAULTS = {"max_new_tokens": 4, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0}
CONTEXT = 200  # "tokens" are UTF-8 bytes here


class Killed(BaseException):
    """Stands for SIGKILL in-process: nothing in the job layer may catch it."""


def fake_result(prompt: str, fields: dict) -> dict:
    h = hashlib.sha256((prompt + json.dumps(fields, sort_keys=True)).encode("utf-8")).digest()
    n = min(fields["max_new_tokens"], 6)
    ids = list(h[:n])
    return {"output": "".join(chr(65 + t % 26) for t in ids), "output_ids": ids, "num_prompt_tokens":
            len(prompt.encode("utf-8")), "num_tokens": n, "finish_reason": "length" if n < 6 else "eos"}


def prepare(rec):
    n = len(rec.prompt.encode("utf-8"))
    if n >= CONTEXT:
        raise SpecjaxError(f"prompt has {n} tokens but the context is {CONTEXT}")
    return rec.prompt, rec.fields


class FakeModel:
    def __init__(self, kill_after: int | None = None, sleep: float = 0.0, on_emit=None):
        self.failed: set[str] = set()
        self.kill_after = kill_after
        self.sleep = sleep
        self.on_emit = on_emit
        self.emitted = 0
        self.calls = 0

    def generate(self, items, emit):
        self.calls += 1
        fresh = {p for p, _ in items if "FAIL-ONCE" in p and p not in self.failed}
        if fresh:  # a transient error that takes the whole batch down, once
            self.failed |= fresh
            raise RuntimeError("transient device error (injected)")
        for i, (prompt, fields) in enumerate(items):
            if self.sleep:
                time.sleep(self.sleep)
            if "FAIL-ALWAYS" in prompt:
                raise RuntimeError("device error (injected)")
            if "REJECT" in prompt:
                emit(i, error="rejected by the engine (injected)")
            else:
                emit(i, result=fake_result(prompt, fields))
            self.emitted += 1
            if self.on_emit is not None:
                self.on_emit(self.emitted)
            if self.kill_after is not None and self.emitted >= self.kill_after:
                raise Killed()


def run_job(inp, out, *, batch=3, model=None, fsync=True, log=None, replica=(0, 1)) -> int:
    from specjax.jobs import Job

    model = model or FakeModel()
    with Job(inp, out, DEFAULTS, fsync=fsync, log=log, progress=False, replica=replica) as job:
        return job.serve(prepare, model.generate, batch=batch)


def main(argv):
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("inp")
    p.add_argument("out")
    p.add_argument("--batch", type=int, default=3)
    p.add_argument("--sleep", type=float, default=0.0)
    a = p.parse_args(argv)
    try:
        return run_job(a.inp, a.out, batch=a.batch, model=FakeModel(sleep=a.sleep))
    except SpecjaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
