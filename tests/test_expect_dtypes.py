"""Results are compared in the dtype the assignment text states (issue 39): the float64 truth
is never cast down to the dtype a student returned. Before, int64 zeros "matched" LeNet weights
below 1 (the truth truncated to int64 is zeros too), so a ``train_batch`` that trained nothing
scored 4/4 in A1. Plain unit tests of :mod:`autograder.checking.expect`; the same on real
gradings: tests/test_loose_comparisons.py.

Tier: quick.
"""
from __future__ import annotations

import pytest
import torch

from autograder.checking.expect import assert_close, assert_close_float32


def small_weights(seed: int = 0):
    """A float64 truth with entries below 1 (as LeNet's, scale 0.1) and its float32 run."""
    g = torch.Generator().manual_seed(seed)
    truth = 0.1 * torch.randn(6, 5, generator=g, dtype=torch.float64)
    return truth, truth.float()


def test_int64_zeros_against_small_float_weights_fail_naming_the_dtype():
    truth, truth32 = small_weights()
    assert (truth.to(torch.int64) == 0).all()   # what the old comparison compared them with
    with pytest.raises(AssertionError) as failed:
        assert_close_float32(torch.zeros(6, 5, dtype=torch.int64), truth, truth32,
                             "replica 0 parameter 0", seed=3)
    message = str(failed.value)
    assert "has dtype torch.int64" in message and "expected torch.float32" in message, message
    assert "seed 3" in message


def test_the_state_converted_to_int64_fails_too():
    truth, truth32 = small_weights(1)
    with pytest.raises(AssertionError, match="has dtype torch.int64, expected torch.float32"):
        assert_close_float32(truth32.to(torch.int64), truth, truth32, "parameter 2")


def test_a_bool_tensor_fails():
    truth, truth32 = small_weights(2)
    with pytest.raises(AssertionError, match="has dtype torch.bool, expected torch.float32"):
        assert_close_float32(torch.zeros(6, 5, dtype=torch.bool), truth, truth32, "parameter 0")


def test_float32_within_tolerance_passes_and_a_real_error_still_fails():
    truth, truth32 = small_weights(3)
    assert_close_float32(truth32, truth, truth32, "parameter 0")
    nudged = truth32.clone()
    nudged[0, 0] += 1e-7 * max(1.0, truth.abs().max().item())  # float32 rounding's order
    assert_close_float32(nudged, truth, truth32, "parameter 0")
    wrong = truth32.clone()
    wrong[2, 3] += 1e-2
    with pytest.raises(AssertionError, match="wrong values"):
        assert_close_float32(wrong, truth, truth32, "parameter 0")


def test_a_float64_result_is_judged_on_its_values_cast_up_not_the_truth_down():
    """No text states float32 for these results: float64 is fair, compared in float64."""
    truth, truth32 = small_weights(4)
    assert_close_float32(truth.clone(), truth, truth32, "parameter 0")
    wrong = truth.clone()
    wrong[1, 1] += 1e-3
    with pytest.raises(AssertionError, match=r"returned as torch\.float64.*wrong values"):
        assert_close_float32(wrong, truth, truth32, "parameter 0")


def test_half_precision_is_cast_up_and_fails_on_its_rounding():
    """float16 is a float dtype (judged on its values), but its rounding is far above the
    float32 tolerance: the truth cast down to float16 would have hidden that."""
    truth, truth32 = small_weights(5)
    half = truth32.half()
    with pytest.raises(AssertionError, match=r"returned as torch\.float16.*wrong values"):
        assert_close_float32(half, truth, truth32, "parameter 0")


def test_shape_is_still_checked():
    truth, truth32 = small_weights(6)
    with pytest.raises(AssertionError, match="has shape"):
        assert_close_float32(truth32.flatten(), truth, truth32, "parameter 0")


def test_assert_close_keeps_its_exact_dtype():
    """The sibling helper compares in the expected dtype only: an int tensor never passes a
    float expectation."""
    expected = torch.full((3,), 0.25, dtype=torch.float64)
    with pytest.raises(AssertionError, match="has dtype torch.int64, expected torch.float64"):
        assert_close(torch.zeros(3, dtype=torch.int64), expected, "x")
    assert_close(expected.clone(), expected, "x")
