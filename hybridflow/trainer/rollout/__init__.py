"""The driver's rollout handle: where a step's responses come from and how weights reach the engines.

    rollout.sync_weights(policy)         the engines serve the policy's current weights from now on
    rollout.responses(prompts, steps_left)  the step's prompts and responses (generated now, launched
                                         earlier, or a stream's next finished groups)
    rollout.generate(rows)               responses now (validation, ReMax's greedy baseline)
    rollout.metrics(batch)               staleness / overlap / version metrics of a trained batch
    rollout.save(path) / load(path)      what the rollout holds (sampling positions, what is in flight)

Implementations (`base.Rollout` is the protocol):
- `colocated.ColocatedRollout`: the hybrid engine; the engines live in the policy's processes and
  the sync reshards the actor's weights into them in memory;
- `pool.PoolRollout`: a rollout pool of its own (trainer.placement=disaggregated); the sync is a
  transfer over a process group, and every sample carries the policy version that produced it;
- `ahead.GeneratingAhead`: one_step / async (and partial rollouts): wraps a pool and keeps up to
  `depth` batches generating while the driver trains on earlier ones; it holds the queue;
- `stream.StreamingRollout`: stream (and its checkpoint part): wraps a pool, keeps every prompt's
  group generating on its own and gives a step the next finished groups within the staleness bound.
- `routed.RoutedAgentRollout`: tool-agent loops over a pool (sync): the loops run on the driver,
  and `router.Router` sends each turn to a replica, a session's turns to the replica of its last.

`unread` names the prompts a checkpoint holds drawn ahead by another mode than the resumed run's.
"""
