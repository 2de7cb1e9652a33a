"""Checks that run on the driver before any worker starts, one module per subject, each refusing
a bad input with one error naming the recipe key or file and the fix (docs/bad-inputs.md).

`models`: a model directory's weights against its config.json, what a checkpoint will take, and
the routing-replay settings against the policy's model. The driver runs them from
`hybridflow.trainer.preflight.check_run_inputs`, after `hybridflow.config.validate.validate_recipe`.
"""
