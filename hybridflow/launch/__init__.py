"""Launch helpers: this node's address for Ray, and the check that a Ray cluster can hold a recipe.

Used by scripts/slurm/run_recipe.sbatch and by the trainer before any worker starts; imports only
the standard library at module level (Ray is imported where a live cluster is queried).
"""
