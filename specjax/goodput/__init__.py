"""SmartSpec goodput: acceptance estimators, the linear performance model, the K selector."""

from specjax.goodput.acceptance import (AcceptanceCounts, AcceptanceEstimator, MovingAverage, ScoreCalibration,
                                        confidence_lengths, expected_len, expected_len_from_positions,
                                        tree_batched_tokens, tree_expected_len)
from specjax.goodput.perf_model import LinearCost, StepCostModel, fit_linear, fit_step_model, r_squared
from specjax.goodput.selector import BatchView, DraftPrefillGate, FixedK, GoodputPolicy, Policy

__all__ = ["AcceptanceCounts", "AcceptanceEstimator", "MovingAverage", "ScoreCalibration", "confidence_lengths",
           "expected_len", "expected_len_from_positions", "tree_batched_tokens", "tree_expected_len", "LinearCost",
           "StepCostModel", "fit_linear", "fit_step_model", "r_squared", "BatchView", "DraftPrefillGate", "FixedK",
           "GoodputPolicy", "Policy"]
