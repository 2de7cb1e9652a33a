"""Where the rollout runs and how far generation runs ahead of training (trainer.placement,
trainer.async_training, docs/async.md): what each mode needs, and no setting a mode ignores.
"""

import logging

from hybridflow.config.schema import RecipeConfig

logger = logging.getLogger(__name__)


def _check_placement(cfg: RecipeConfig) -> list[str]:
    """A rollout pool exactly when the placement is disaggregated, and one the engines split over."""
    trainer, pool = cfg.trainer, cfg.trainer.rollout_pool
    if trainer.placement == "colocated":
        return _colocated_unused(cfg)
    if trainer.mode != "rl":
        return ["trainer.placement=disaggregated applies to trainer.mode=rl only; set it to colocated"]
    if pool.nnodes < 1 or pool.n_gpus_per_node < 1:
        return [
            "trainer.placement=disaggregated needs trainer.rollout_pool.nnodes >= 1 and "
            f"trainer.rollout_pool.n_gpus_per_node >= 1 (the engines' devices; processes on CPU), got "
            f"{pool.nnodes} and {pool.n_gpus_per_node}"
        ]
    errors = []
    devices, engine_tp = pool.nnodes * pool.n_gpus_per_node, cfg.rollout.tensor_model_parallel_size
    if devices % engine_tp:
        errors.append(
            f"rollout.tensor_model_parallel_size={engine_tp} does not divide the rollout pool's {devices} "
            "devices (trainer.rollout_pool.nnodes x n_gpus_per_node)"
        )
    if engine_tp != 1:
        errors.append(
            "trainer.placement=disaggregated runs one engine per rollout process for now: set "
            f"rollout.tensor_model_parallel_size=1, got {engine_tp}"
        )
    return errors + _disaggregated_not_built(cfg)


def _colocated_unused(cfg: RecipeConfig) -> list[str]:
    """Settings of the rollout pool's transfers, which a colocated rollout never makes."""
    pool, errors = cfg.trainer.rollout_pool, []
    if pool.n_gpus_per_node != 0:
        errors.append(
            f"trainer.rollout_pool.n_gpus_per_node={pool.n_gpus_per_node} gives the rollout its own devices, "
            "which only trainer.placement=disaggregated uses: set that, or set n_gpus_per_node to 0"
        )
    if cfg.rollout.weight_sync_delta:
        errors.append(
            "rollout.weight_sync_delta=true applies to trainer.placement=disaggregated (a colocated sync "
            "loads the weights in the actor's own processes, sending nothing): set it to false"
        )
    return errors


def _disaggregated_not_built(cfg: RecipeConfig) -> list[str]:
    """What the rollout pool cannot do yet, refused rather than silently left out (docs/async.md)."""
    loop, mode = cfg.rollout.agent.loop, cfg.trainer.async_training.mode
    agents = loop != "single_turn"
    unbuilt = {
        "rollout.name=sglang": cfg.rollout.name == "sglang",
        f"rollout.agent.loop={loop}": loop == "environment",
        f"rollout.agent.loop={loop} in trainer.async_training.mode={mode}": agents and mode != "sync",
        "rollout.verify_weight_sync=true": cfg.rollout.verify_weight_sync,
    }
    return [
        f"{setting} with trainer.placement=disaggregated is not built yet (docs/async.md); use colocated"
        for setting, used in unbuilt.items()
        if used
    ]


def _check_async_training(cfg: RecipeConfig) -> list[str]:
    """What each mode needs, and no setting a mode ignores (docs/async.md)."""
    settings, key = cfg.trainer.async_training, "trainer.async_training"
    errors = []
    if settings.mode != "sync" and cfg.trainer.mode != "rl":
        errors.append(f"{key}.mode={settings.mode} applies to trainer.mode=rl only; set it to sync")
    if settings.mode != "sync" and cfg.trainer.placement == "colocated":
        errors.append(
            f"{key}.mode={settings.mode} overlaps generation with training, which needs the rollout on "
            "its own devices: set trainer.placement=disaggregated and trainer.rollout_pool.n_gpus_per_node"
        )
    if settings.mode != "sync" and cfg.algorithm.adv_estimator == "remax":
        errors.append(
            f"{key}.mode={settings.mode} with algorithm.adv_estimator=remax: the greedy baseline would come "
            "from newer weights than the samples it is a baseline for; use mode=sync"
        )
    if settings.mode == "async" and settings.max_staleness < 0:
        errors.append(f"{key}.max_staleness must be >= 0 (0: as fresh as sync), got {settings.max_staleness}")
    if settings.mode not in ("async", "stream") and settings.max_staleness != 1:
        errors.append(
            f"{key}.max_staleness={settings.max_staleness} is used by mode=async only (sync trains on "
            "fresh samples, one_step on samples one version old); set mode=async or remove it"
        )
    errors += _check_stream(cfg) + _check_sync_every(cfg)
    if settings.partial_rollout and settings.mode == "stream":
        errors.append(
            f"{key}.partial_rollout=true: mode=stream always continues requests under new weights; remove it"
        )
    elif settings.partial_rollout and settings.mode != "async":
        errors.append(f"{key}.partial_rollout=true is used by mode=async only; set mode=async or remove it")
    elif settings.partial_rollout and settings.batches_ahead() < 2:
        lag = f" and sync_every={settings.sync_every}" if settings.sync_every > 1 else ""
        errors.append(
            f"{key}.partial_rollout=true with max_staleness={settings.max_staleness}{lag}: no request is in "
            "flight when weights arrive (each launched batch is collected before the next transfer); set "
            f"max_staleness >= {settings.sync_every + 1} or remove partial_rollout"
        )
    if settings.partial_rollout and cfg.rollout.name == "hf":
        errors.append(
            f"{key}.partial_rollout=true pauses in-flight requests for a weight update, which transformers "
            "generate cannot do: use rollout.name=vllm (or sglang on GPUs)"
        )
    return errors


def _check_sync_every(cfg: RecipeConfig) -> list[str]:
    """sync_every: at least 1, in the modes that generate ahead, and within the staleness bound: the
    engines may serve weights sync_every - 1 updates old, on top of the batches generated ahead."""
    settings, key = cfg.trainer.async_training, "trainer.async_training"
    every, bound = settings.sync_every, settings.max_staleness
    if every < 1:
        return [f"{key}.sync_every must be >= 1 (1: a weight transfer after every update), got {every}"]
    if every > 1 and settings.mode == "sync":
        return [
            f"{key}.sync_every={every} is used by mode=one_step, async or stream only (mode=sync generates "
            "every batch with the newest weights); set one of those modes or remove sync_every"
        ]
    if every > 1 and settings.mode in ("async", "stream") and every > bound:
        return [
            f"{key}.sync_every={every} with max_staleness={bound}: the engines' weights may be {every - 1} "
            "update(s) old, so a batch generated ahead with them would be trained staler than the bound; "
            f"set max_staleness >= {every} (max_staleness - sync_every + 1 batches then generate ahead) "
            f"or sync_every <= {bound}"
        ]
    return []


def _check_stream(cfg: RecipeConfig) -> list[str]:
    """mode=stream: request-level generation, and a staleness bound it can keep (docs/async.md)."""
    settings, key = cfg.trainer.async_training, "trainer.async_training"
    if settings.mode != "stream" and settings.stale_groups != "drop":
        return [f"{key}.stale_groups={settings.stale_groups} is used by mode=stream only; remove it"]
    if settings.mode != "stream":
        return []
    errors = []
    if settings.max_staleness < 1:
        errors.append(
            f"{key}.max_staleness={settings.max_staleness} with mode=stream: a group generating while "
            "a step trains is one version old when it finishes, so every group would be dropped; use "
            "mode=sync for fresh samples, or max_staleness >= 1"
        )
    if cfg.rollout.name != "vllm":
        errors.append(
            f"{key}.mode=stream runs each group as requests between which weights land, which only the "
            f"vLLM engine does here: set rollout.name=vllm (got {cfg.rollout.name})"
        )
    return errors


def _check_top_k_requests(cfg: RecipeConfig) -> list[str]:
    """rollout.top_k_log_probs comes with the engines' batch calls; the request-level generation of
    partial rollouts and mode=stream (engines/rollout/request_batches.py) does not return it yet."""
    k, settings = cfg.rollout.top_k_log_probs, cfg.trainer.async_training
    uses = {"partial_rollout=true": settings.partial_rollout, "mode=stream": settings.mode == "stream"}
    return [
        f"rollout.top_k_log_probs={k} with trainer.async_training.{setting}: request-level generation "
        "does not return the top-K log-probs yet; set rollout.top_k_log_probs=0"
        for setting, used in uses.items()
        if k and used
    ]


def warn_if_staleness_is_out_of_reach(cfg: RecipeConfig, train_rows: int) -> None:
    """A warning when trainer.async_training.max_staleness is at least the run's steps: a sample of
    a run of T steps is at most T - 1 versions old, so such a bound only has every batch generated
    ahead from the first weights. Legal (a short smoke test of a long run's recipe), so not refused."""
    trainer, staleness = cfg.trainer, cfg.trainer.async_training.max_staleness
    steps = trainer.total_training_steps or train_rows // cfg.data.train_batch_size * trainer.total_epochs
    if trainer.async_training.mode == "async" and staleness >= steps:
        logger.warning(
            "trainer.async_training.max_staleness=%d is beyond what this run reaches: it trains %d steps, "
            "so no sample is more than %d version(s) old, and the bound only has every batch generated "
            "ahead from the first weights; lower it to %d or less, or train more steps",
            staleness, steps, steps - 1, max(steps - 1, 0),
        )  # fmt: skip
