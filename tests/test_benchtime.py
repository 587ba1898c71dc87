"""The benchmark harness (specjax.benchtime) on a fake clock, and the peers' subprocess contract
(specjax.peers): rotated rounds, dropped warm-up, samples as rows, the one-line errors of a
missing peer environment. No timing is asserted."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

from specjax import benchtime, peers
from specjax.errors import SpecjaxError


class FakeClock:
    """Each variant call advances time by its cost; a drift term grows with every call."""

    def __init__(self, drift: float = 0.0):
        self.now, self.drift, self.calls = 0.0, drift, 0

    def __call__(self):
        return self.now

    def spend(self, cost):
        self.calls += 1
        self.now += cost + self.drift * self.calls


def test_rounds_rotate_drop_warmup_and_merge_samples():
    clock, log = FakeClock(), []

    def variant(name, cost):
        def run():
            log.append(name)
            clock.spend(cost)
            return {"own": cost * 10} if name == "b" else None
        return run

    out = benchtime.rounds({"a": variant("a", 1.0), "b": variant("b", 2.0), "c": variant("c", 3.0)}, reps=3,
                           warmup=1, clock=clock)
    # round r starts at variant r mod 3; the warm-up round's samples are dropped
    assert log == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert {n: len(v) for n, v in out.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(s == {"s": 1.0} for s in out["a"])
    assert all(s == {"s": 2.0, "own": 20.0} for s in out["b"])
    assert benchtime.summarize(out["b"]) == {"s": 2.0, "own": 20.0}


def test_rotation_spreads_drift_over_the_variants():
    """Two equal-cost variants on a machine slowing down call by call: in rotated rounds neither
    takes the drift alone, so their medians agree; back to back, the second would pay it all."""
    clock = FakeClock(drift=0.01)

    def run():
        clock.spend(1.0)

    med = benchtime.interleaved_medians({"x": run, "y": run}, reps=4, clock=clock)
    back_to_back = [benchtime.median_seconds(run, 4, clock=clock) for _ in range(2)]
    assert abs(med["x"] - med["y"]) < abs(back_to_back[1] - back_to_back[0])


def test_shuffled_rounds_and_best_of():
    clock, log = FakeClock(), []

    def variant(n):
        def run():
            log.append(n)
            clock.spend(float(n))
        return run

    out = benchtime.rounds({k: variant(k) for k in (1, 2, 4)}, reps=2, shuffle=np.random.default_rng(0), clock=clock)
    assert sorted(log) == [1] * 3 + [2] * 3 + [4] * 3 and {k: len(v) for k, v in out.items()} == {1: 2, 2: 2, 4: 2}
    # interleaved_medians drops what a variant returns (a jax array, say) and can take the best
    assert benchtime.median_seconds(lambda: clock.spend(1.0) or np.ones(3), 3, stat=min, clock=clock) == 1.0


def test_summarize_keeps_numbers_only():
    rows = [{"s": 1.0, "steps": 3, "tokens": [1, 2], "ok": True}, {"s": 3.0, "steps": 5, "tokens": [1], "ok": True}]
    assert benchtime.summarize(rows) == {"s": 2.0, "steps": 4}
    assert benchtime.summarize(rows, min) == {"s": 1.0, "steps": 3}


def test_peer_missing_environment_is_one_line(tmp_path, monkeypatch):
    with pytest.raises(SpecjaxError, match="not an executable Python"):
        peers.run_peer("hf_pld", str(tmp_path / "nope" / "python"), {})
    # an environment without a module the peer imports: refused before the peer starts
    monkeypatch.setitem(peers.PEERS, "needy", peers.Peer("benchmarks/hf_pld.py", ("json", "no_such_module_xyz")))
    with pytest.raises(SpecjaxError, match=r"cannot import no_such_module_xyz \(install") as e:
        peers.run_peer("needy", sys.executable, {})
    assert "\n" not in str(e.value)


def test_peer_contract_round_trip(tmp_path, monkeypatch):
    """A peer script reads its job and writes its result through peer_main; run_peer returns it."""
    script = tmp_path / "echo_peer.py"
    script.write_text("import sys\nfrom specjax.peers import peer_main\n"
                      "sys.exit(peer_main(lambda job: {'rows': [x * 2 for x in job['xs']]}))\n")
    monkeypatch.setitem(peers.PEERS, "echo", peers.Peer(str(script), ("json",)))
    res = peers.run_peer("echo", sys.executable, {"xs": [1, 2]})
    assert res["rows"] == [2, 4] and res["env"]["subprocess_s"] > 0
    failing = tmp_path / "fail_peer.py"
    failing.write_text("import sys\nsys.exit(3)\n")
    monkeypatch.setitem(peers.PEERS, "fail", peers.Peer(str(failing), ()))
    with pytest.raises(SpecjaxError, match="exit status 3"):
        peers.run_peer("fail", sys.executable, {})


def test_lockstep_alternates_two_threads_and_counts_their_waits():
    """benchtime.LockStep: neither starts before both arrive, units then strictly alternate, a
    finished thread leaves its partner to run alone, and each thread's waiting is counted."""
    import threading

    step = benchtime.LockStep()
    log: list = []

    def worker(i, units, delay):
        time.sleep(delay)  # (a compilation before serving: the partner waits for it)
        for u in range(units):
            step.turn(i)
            log.append(i)
        step.finish(i)

    ts = [threading.Thread(target=worker, args=(0, 5, 0.0)), threading.Thread(target=worker, args=(1, 3, 0.2))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert not any(t.is_alive() for t in ts)
    assert log == [0, 1, 0, 1, 0, 1, 0, 0]
    assert step.waited[0] >= 0.15 and step.waited[1] < 0.15  # thread 0 waited for thread 1's start
