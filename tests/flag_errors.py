"""Run one launch script's main once per argument list in one process and report each run's exit
status and stderr: the bad-flag tests of a script (each a one-line ``error:``, exit 2) pay for
one Python and jax start-up instead of one per case.

Each case: the script's flags re-parsed from defaults, ``main`` called as ``app.run`` calls it,
stdout and stderr captured at the file-descriptor level (print, logging and C-level writes alike),
SystemExit's code kept as the exit status. A flags parsing error is exit 1 with absl's message (as
``app.run`` would); any other exception escaping ``main`` is exit 1 with its traceback in stderr,
so a test's "no Traceback" check sees it.

  python tests/flag_errors.py SCRIPT.py CASES.json OUT.json    (CASES: a JSON list of argv lists)

``run_cases(script, cases)`` runs that in a subprocess from a test and returns [(code, stderr)]."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cases(script: str, cases: list[list[str]], timeout: float = 600) -> list[tuple[int, str]]:
    """[(exit status, stderr)] of ``script`` run with each argument list of ``cases``."""
    with tempfile.TemporaryDirectory() as d:
        inp, out = os.path.join(d, "cases.json"), os.path.join(d, "out.json")
        with open(inp, "w") as f:
            json.dump(cases, f)
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        r = subprocess.run([sys.executable, os.path.abspath(__file__), script, inp, out], capture_output=True,
                           text=True, timeout=timeout, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        with open(out) as f:
            return [(c, e) for c, e in json.load(f)]


def assert_one_line_error(code: int, err: str, message: str) -> None:
    """What every bad-input case must give: exit status 2, no traceback, and a last line
    ``error: ...`` that contains ``message``."""
    assert code == 2, err[-2000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, err[-2000:]


def _one(mod, script: str, argv: list[str]) -> tuple[int, str]:
    import traceback

    from absl import flags

    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as cap:
        os.dup2(cap.fileno(), 1)
        os.dup2(cap.fileno(), 2)
        try:
            try:
                flags.FLAGS.unparse_flags()
                flags.FLAGS([script, *argv])
            except flags.Error as e:
                print(f"FATAL Flags parsing error: {e}", file=sys.stderr)
                code = 1
            else:
                try:
                    mod.main([script])
                    code = 0
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                except BaseException:  # as app.run: the traceback on stderr, a failing status
                    traceback.print_exc()
                    code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        cap.seek(0)
        return code, cap.read().decode("utf-8", "replace")


def main(script: str, cases_path: str, out_path: str) -> None:
    import importlib

    sys.path.insert(0, ROOT)
    sys.argv = [script]
    name = os.path.splitext(os.path.relpath(os.path.abspath(script), ROOT))[0].replace(os.sep, ".")
    mod = importlib.import_module(name)  # (launch.batch etc., not as __main__: its app.run line does not run)
    if hasattr(mod, "define_flags"):
        mod.define_flags()
    with open(cases_path) as f:
        cases = json.load(f)
    res = [_one(mod, script, argv) for argv in cases]
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
