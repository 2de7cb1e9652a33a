"""The collapse guard on the worker: the update-to-weight ratio predicted before an optimizer step
is the one the step makes, and a step beyond max_update_ratio is not applied (see
_update_ratio_step.py)."""

import json

import pytest
from launch import run_distributed


def test_predicted_update_ratio_is_the_step_taken_and_a_too_large_step_is_refused():
    output = run_distributed("_update_ratio_step.py", 1)
    results = json.loads(next(line for line in output.splitlines() if line.startswith("RESULT "))[7:])
    steps = results["steps"]
    assert [s["grad_norm"] > 1.0 for s in steps] == [True, False, True, False]  # clipped, then not
    for step in steps:
        assert step["predicted"] == pytest.approx(step["actual"], rel=1e-4), step
    refused = results["refused"]
    assert refused["step"]["update_refused"] == 1.0 and refused["step"]["update_ratio_max"] > 0.25
    assert refused["step"]["nonfinite_skipped"] == 0.0
    assert refused["unchanged"] and refused["scheduler_steps"] == 0
