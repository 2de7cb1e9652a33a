"""Checks that run on the driver before any worker starts, one module per subject, each refusing
a bad input with one error naming the recipe key or file and the fix (docs/bad-inputs.md).

`recipe`: `validate_recipe(cfg)` (the recipe alone: ranges, paths, every rule below, all problems
at once as one `RecipeError`) and `check_run_inputs(cfg)` (the files it names), which the driver
runs in that order (`hybridflow.trainer.main.checked_recipe`). The subjects: `models` (each model
directory, its weights and tokenizer, a checkpoint's size), `data` (prompt files or a generated
source, the datasets and reward inputs), `engines` (the engines' validators, devices, LoRA, context
length, vLLM's CPU build), `layout` (devices over the roles, batch sizes, token budgets),
`algorithm`, `async_training` (placement and generating ahead), `agents` (tools, environments, the
chat template), `distillation` (the teacher's settings and tokenizer), `vlm` (a vision-language
policy), `resume` (the checkpoint to resume from); `roles` and `settings` are what they share.
"""
