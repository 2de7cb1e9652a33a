"""A NaN / inf gradient norm is caught before the optimizer step: the update is not applied
(weights, Adam moments, LR schedule unchanged) and reported for the driver to act on."""

import json
import math

from launch import run_distributed


def test_nonfinite_grad_norm_skips_the_update_and_reports_it():
    output = run_distributed("_nonfinite_step.py", 1)
    results = json.loads(next(line for line in output.splitlines() if line.startswith("RESULT "))[7:])
    for name in ("nan", "inf"):
        step = results[name]["step"]
        assert not math.isfinite(step["grad_norm"]) and step["nonfinite_skipped"] == 1.0, name
        assert results[name]["unchanged"] and results[name]["scheduler_steps"] == 0, name
    finite = results["finite"]
    # all-ones gradients of a 2x3 weight and a 2-vector bias: norm sqrt(8)
    assert abs(finite["step"]["grad_norm"] - math.sqrt(8)) < 1e-6
    assert finite["step"]["nonfinite_skipped"] == 0.0
    assert finite["changed"] and finite["scheduler_steps"] == 1
