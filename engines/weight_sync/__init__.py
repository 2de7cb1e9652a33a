"""The actor's weights into rollout engines: one HF-named tensor stream, one module per way it travels.

Import the submodule you need; this package imports nothing on its own (the engines import
`common` and `model_shapes`; only the sync paths import Megatron-Core).

The stream. `engines.megatron.weights.iter_hf_tensors(actor_chunks, hf_config)` yields the actor's
tensors under their Hugging Face names, each gathered across its tensor-parallel group, sent from
the pipeline stage that owns it, fused tensors (QKV, gate/up) split. It is a collective: every rank
of the actor's model-parallel group iterates it in lockstep, so every way below consumes the whole
stream on every rank, even after a failure, and reports the failure afterwards on every rank.

The ways weights move:
- `colocated`: the hybrid engine. The engine lives in the actor's own processes; the stream is
  loaded in memory, bucket by bucket, inside one weight-update session per sync
  (`ColocatedWeightSync`, held by `engines.rollout.sharding_manager`, which also releases and
  resumes the engine's memory around it).
- `transfer` (trainer.placement=disaggregated): a process group of its own from the actor's rank 0
  to a pool of engines in other processes, one header and one payload broadcast per bucket
  (`WeightSender` / `WeightReceiver`; the policy worker's rank 0 sends, each rollout worker
  receives into its engine). With rollout.weight_sync_delta each tensor goes as its elements that
  changed since the version every receiver holds (`delta`: lossless, checked by checksum), whole
  after a restart.
- `adapters` (`actor.lora.sync=adapters`, vLLM): the frozen base weights streamed once, then only
  the LoRA adapters under peft's names at each sync (`AdapterWeightSync`).

The bucket format. `common.bucket_named_tensors` cuts the stream into consecutive lists of
(hf_name, tensor) of at most `rollout.weight_sync_bucket_mb` MiB each (a larger tensor forms a bucket
on its own), in stream order, without copying: the unit an engine loads at once and the peak of
extra memory a sync needs.

What is checked, and when:
- before anything is sent (when the colocated sync is built, on every rank together): the names and
  shapes of the stream against the model the rollout engine serves (`hf_config.source_dir`, built
  on the meta device: `model_shapes.expected_hf_tensor_shapes`, `common.weight_stream_problem`). A load
  that fails inside SGLang returns nothing: the scheduler's exception kills the engine's whole
  process tree, this worker included (sglang 0.5.23 managers/scheduler.py 6369,
  tokenizer_manager.py 4072-4081), and an unknown name is skipped with only a warning
  (models/qwen2.py 719). So a mismatch stops every rank with a `WeightSyncError` naming the tensor.
- per bucket: the hf and vLLM engines refuse a name or shape they do not hold
  (`common.check_named_shapes`); SGLang refuses an update outside a weight-update session. Either
  becomes a `WeightSyncError` naming the bucket, raised on every rank after the stream is consumed.
  So does any other error of an engine's load on one rank (out of memory ...): the rank keeps
  consuming the stream, so that no peer is left waiting for it in the stream's collectives.
- after the sync, with `rollout.verify_weight_sync`: each tensor's checksum (cast to the rollout
  dtype, `common.tensor_checksum`) against the engine's copy; the first differing name stops every
  rank. vLLM repacks its weights (no exact read-back): there the engine's log-probs of fixed tokens
  (`colocated.log_prob_probe`) are compared with the actor's, within a tolerance of the rollout dtype.

The checkpoint on disk is checked separately, by the driver before Ray starts (safetensors headers
against config.json): hybridflow/checks/models.py.
"""
