"""The suite's XLA settings (tests/suite_xla.py): flags this XLA does not take are dropped, not
fatal (XLA aborts a process on an unknown flag), and what the suite runs with is what was checked."""

import os

import suite_xla


def test_an_xla_that_refuses_a_flag_gets_the_O0_flag_alone(monkeypatch):
    monkeypatch.delenv(suite_xla._CHECKED)
    monkeypatch.setattr(suite_xla, "SUITE_XLA_FLAGS", suite_xla.SUITE_XLA_FLAGS + ("--xla_no_such_flag=1",))
    assert suite_xla.suite_flags() == ("--xla_backend_optimization_level=0",)
    assert suite_xla.run_time_options() == {"xla_backend_optimization_level": 3}


def test_this_suite_runs_with_the_flags_it_checked():
    flags = suite_xla.suite_flags()
    assert flags[0] == "--xla_backend_optimization_level=0" and set(flags) <= set(suite_xla.SUITE_XLA_FLAGS)
    assert all(f in os.environ["XLA_FLAGS"].split() for f in flags)
