"""Fixtures shared across test modules, and the ``--shared_dir`` option.

Tests marked ``shared_data`` read the public prompt sets (Spec-Bench, GSM8K, HumanEval) from the
folder given by ``--shared_dir`` (or $SPECJAX_SHARED_DIR; default ``../shared`` beside the
repository), through the ``shared_data_dir`` fixture (its ``data/`` subfolder). Without that folder
they are skipped with a reason saying how to run them, except in CI ($CI set, or ``--shared_dir``
given explicitly), where a missing folder is an error."""

from __future__ import annotations

import gc
import os

# XLA:CPU tuned for compile time for the whole suite, launch scripts it runs included (they
# inherit the environment): tests/suite_xla.py says which flags and why.
from suite_xla import suite_flags  # noqa: E402

os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), *suite_flags()]))
# Background compiles at normal priority (engine.table.yield_to_serving): the suite's two worker
# processes keep both cores busy, so a lowered thread that a test waits for would wait behind the
# other worker. (Tests check tokens and counts, never speed.)
os.environ.setdefault("SPECJAX_BACKGROUND_NICE", "0")

import jax  # noqa: E402
import pytest

from specjax.config import get_model_config
from specjax.models import llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SHARED = os.path.join(ROOT, "..", "shared")


def pytest_addoption(parser):
    parser.addoption("--shared_dir", default=None,
                     help="the shared folder holding data/spec_bench, data/gsm8k, data/humaneval, read by tests "
                          "marked shared_data (default: $SPECJAX_SHARED_DIR, else ../shared beside the repository); "
                          "given explicitly, a missing folder is an error")


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _shared_dir(config) -> tuple[str, bool]:
    """(the shared folder, whether it was asked for: --shared_dir, $SPECJAX_SHARED_DIR or CI)."""
    given = config.getoption("shared_dir") or os.environ.get("SPECJAX_SHARED_DIR")
    return os.path.abspath(given or DEFAULT_SHARED), bool(given) or _ci()


@pytest.fixture
def shared_data_dir(request):
    """The shared ``data/`` folder, for tests marked shared_data (skipped without it outside CI)."""
    if request.node.get_closest_marker("shared_data") is None:
        pytest.fail("a test using shared_data_dir must be marked @pytest.mark.shared_data", pytrace=False)
    path, required = _shared_dir(request.config)
    data = os.path.join(path, "data")
    if not os.path.isdir(data):
        msg = (f"needs the shared prompt data: {data} not found; run with --shared_dir PATH "
               f"(or SPECJAX_SHARED_DIR=PATH), PATH holding data/spec_bench, data/gsm8k, data/humaneval")
        if required:
            pytest.fail(msg + " (required here: --shared_dir, $SPECJAX_SHARED_DIR or $CI is set)", pytrace=False)
        pytest.skip(msg)
    return data


@pytest.fixture(scope="session", autouse=True)
def _executable_cache(tmp_path_factory):
    """One fresh executable cache for the whole run (specjax.engine.exe_cache): a test whose
    engine compiles what an earlier test compiled (same compile key and argument shapes) loads it
    instead, as a warm launch does. Launch scripts run as subprocesses share it through
    $SPECJAX_CACHE_DIR, so the suite neither reads nor fills the user's ~/.cache/specjax, and a run
    starts cold wherever it runs (CI and a developer's machine time the same work). The xdist
    workers of one run share it (their base temporary folders' parent): the same program is then
    compiled once per run, not once per worker (entries are written by an atomic rename, and a
    damaged one is compiled again). Models loaded from a GGUF keep their prepared arrays there
    too (specjax.models.prepared), so each is prepared once per run."""
    from specjax import runtime
    from specjax.engine import exe_cache
    from specjax.models import prepared

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    root = base / "specjax-cache"
    root.mkdir(exist_ok=True)
    root = str(root)
    old = os.environ.get("SPECJAX_CACHE_DIR")
    os.environ["SPECJAX_CACHE_DIR"] = root
    runtime.enable_compilation_cache(root)  # (executables and prepared models, as launch scripts have them)
    yield
    exe_cache.set_directory(None)
    prepared.set_directory(None)
    if old is None:
        os.environ.pop("SPECJAX_CACHE_DIR", None)
    else:
        os.environ["SPECJAX_CACHE_DIR"] = old


@pytest.fixture
def seed():
    """The seed of a test's random choices (kill points, fuzz inputs): ``$SPECJAX_TEST_SEED`` to
    replay a failure, else a fresh one. Tests name it in their assertion messages."""
    import random

    return int(os.environ.get("SPECJAX_TEST_SEED") or random.randrange(2**32))


@pytest.fixture(scope="module")
def tiny():
    """The tiny random-weight Llama (configs/tiny-random.json) and its params, seed 0."""
    cfg = get_model_config("tiny-random")
    return cfg, llama.init_random_params(cfg, seed=0)


@pytest.fixture(scope="module", autouse=True)
def _release_executables():
    """After each module, drop the executables jax.jit cached for it: every XLA:CPU executable
    holds its code in memory maps of its own, and one process running the whole suite would
    otherwise reach vm.max_map_count (the engine then refuses to compile, check_map_budget)."""
    yield
    jax.clear_caches()
    gc.collect()


# The test files that take longest (about a minute or more of CPU each on a 2-core machine), run
# first: with two workers (pyproject's `-n 2 --dist loadfile`) each takes whole files in
# collection order, so the long ones start at once and the many short ones fill in around them
# instead of one long file running alone at the end. Only an order: a stale list costs balance.
_LONGEST_FIRST = ("test_sharding.py", "test_spec_generate.py", "test_distill.py", "test_launch_matrix.py",
                  "test_batch_job.py", "test_engine.py", "test_tree_attention_kernels.py", "test_device_check.py",
                  "test_verify_tree.py", "test_smollm2_parity.py", "test_chunked_prefill.py", "test_per_request.py",
                  "test_verify_lossless.py", "test_launch_spec.py", "test_eagle.py", "test_ondisk.py",
                  "test_job_reliability.py",
                  "test_prefix_cache.py", "test_pallas_end_to_end.py", "test_rows_dot.py", "test_launch_generate.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda it: rank.get(os.path.basename(str(it.fspath)), len(rank)))  # stable: file order kept
