"""The rollout as its own role (trainer.placement=disaggregated): one process per device of the
rollout pool, each holding a rollout engine and nothing of the actor.

Weights arrive over a transfer group (engines/weight_sync/transfer.py) whose sender is the
actor's rank 0. Joining the group and receiving a transfer are collectives with the actor, which
the driver calls one group at a time: so the rollout side runs them in a background thread
(`start_join_transfer` / `start_receive_weights`) and the driver collects the outcome with
`finish_transfer` after the actor's side returned. Every generated sample carries
`policy_version` (B,): the version of the weights its engine served, `generation_window`
(B, 2): the wall-clock start and end of the call that generated it (the async loop's overlap), and
`rollout_replica` (B,): this process's rank (the step's per-replica metrics).
Checkpoints hold each engine's sampling position (`save_rng_state`), as the colocated worker's do.

When a rollout process dies the driver starts a fresh worker in its slot (PoolRollout.recover):
every member leaves the broken transfer group (`leave_transfer`) and joins a new one, the policy's
weights are sent again, and the fresh engine's log-probs of fixed tokens (`score_log_probs`) are
compared with the actor's before the lost call is generated again.

With partial rollouts (trainer.async_training.partial_rollout) the worker's Ray actor runs several
calls at once (`actor_options`): generation calls run their rows as requests on one event loop
(engines/rollout/request_batches.py), and a transfer is loaded on that loop between two decoding
steps, the rows in flight continuing under the new weights. Rows then carry `rollout_versions`
(B, R), the version of each token, and `policy_version` is that of the row's oldest token.
"""

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from engines.rollout.base import REPLICA_KEY, SamplingPosition
from hybridflow.config.schema import RecipeConfig
from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Worker, register

# How long a member leaving a broken transfer group waits for its receive under way to fail (it
# fails as soon as the sender has dropped the group).
LEAVE_TIMEOUT_S = 60.0


def actor_options(cfg: RecipeConfig) -> dict:
    """Ray actor options of the rollout workers: with partial rollouts, a thread for each launched
    generation call (up to max_staleness), a validation call, and the transfer calls beside them."""
    settings = cfg.trainer.async_training
    if cfg.rollout.agent.loop in ("tool", "openai"):  # a call per turn in flight (trainer/rollout/routed.py)
        return {"max_concurrency": cfg.data.train_batch_size * cfg.rollout.sampling.n + 2}
    if settings.mode == "stream":  # a call per group in flight (hybridflow/trainer/rollout/stream.py)
        pool = cfg.trainer.rollout_pool.nnodes * cfg.trainer.rollout_pool.n_gpus_per_node
        return {"max_concurrency": -(-settings.groups_outstanding(cfg.data.train_batch_size) // pool) + 2}
    return {"max_concurrency": settings.max_staleness + 2} if settings.partial_rollout else {}


class RolloutWorker(Worker):
    def __init__(self, config: RecipeConfig):
        self.config = config
        self.engine = None
        self.batches = None  # RequestBatches with partial rollouts
        self.receiver = None
        self._background = ThreadPoolExecutor(max_workers=1)
        self._pending: Future | None = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from engines.rollout.factory import create_rollout_engine

        cfg = self.config
        if cfg.rollout.tensor_model_parallel_size != 1:
            raise ValueError(
                "trainer.placement=disaggregated runs one engine per rollout process for now: set "
                f"rollout.tensor_model_parallel_size=1, got {cfg.rollout.tensor_model_parallel_size}"
            )
        self.engine = create_rollout_engine(cfg.rollout, cfg.model.path)
        if cfg.rollout.agent.loop in ("tool", "openai"):  # the driver's router sends each turn here
            from engines.rollout.request_batches import RequestBatches

            self.batches = RequestBatches(self.engine, tuple(self._end_of_turn_ids()))
        elif cfg.trainer.async_training.partial_rollout or cfg.trainer.async_training.mode == "stream":
            from engines.rollout.request_batches import RequestBatches

            self.batches = RequestBatches(self.engine)

    def _end_of_turn_ids(self) -> frozenset[int]:
        """Where an agent's turn ends: the chat template's end of turn beside the model's EOS ids."""
        from transformers import AutoTokenizer

        from hybridflow.agents.template import end_of_turn_ids

        tokenizer = AutoTokenizer.from_pretrained(self.config.model.tokenizer_path or self.config.model.path)
        return end_of_turn_ids(tokenizer, self.engine.eos_token_ids)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def start_join_transfer(self, host: str, port: int, size: int) -> None:
        """Join the transfer group as member 1 + this rank (in the background)."""
        from engines.weight_sync.delta import delta_dtype
        from engines.weight_sync.transfer import WeightReceiver, transfer_group

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        delta = delta_dtype(self.config.rollout)

        def join() -> None:
            group = transfer_group(host, port, 1 + self.rank, size, backend)
            self.receiver = WeightReceiver(group, delta_dtype=delta)

        self._start(lambda: self._background.submit(join))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def start_receive_weights(self) -> None:
        """Receive the next transfer into the engine (in the background; with partial rollouts, on
        the engine's event loop between two decoding steps of the rows in flight)."""

        def load() -> int:
            return self.receiver.load_into(self.engine)

        if self.batches is not None:
            self._start(lambda: self.batches.submit_update(load))
        else:
            self._start(lambda: self._background.submit(load))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def finish_transfer(self):
        """Wait for the background join or transfer; its result (the version served), or its error."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("finish_transfer without a started join or transfer")
        return pending.result()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def leave_transfer(self) -> None:
        """Drop this member of a transfer group that lost a member (the sender dropped its end
        first, so a receive under way fails); `start_join_transfer` then joins a new one."""
        pending, self._pending = self._pending, None
        if pending is not None:
            with contextlib.suppress(Exception):  # the broken group's error: expected, dropped
                pending.result(timeout=LEAVE_TIMEOUT_S)
            if not pending.done():  # still stuck: later joins and transfers get a thread of their own
                self._background = ThreadPoolExecutor(max_workers=1)
        self._close_receiver()

    def _close_receiver(self) -> None:
        """End this member's transfer group now (TransferGroup.close), not at the process's exit."""
        if self.receiver is not None:
            self.receiver.group.close()
        self.receiver = None

    def _start(self, start: Callable[[], Future]) -> None:
        if self._pending is not None:
            raise RuntimeError("a weight transfer is already under way on this rollout worker")
        self._pending = start()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Responses to this rank's prompts, each with the `policy_version` (B,) that produced it."""
        self._check_serving()
        start = time.time()  # wall clock: compared with the driver's (hybridflow/trainer/rollout/ahead.py)
        if self.batches is not None:  # versions per token, policy_version set from them
            output = self.batches.generate_sequences(prompts)
        else:
            output = self.engine.generate_sequences(prompts)
            served = torch.full((len(output),), self.receiver.serving, dtype=torch.long)  # (B,)
            output.batch["policy_version"] = served
        window = torch.tensor([start, time.time()], dtype=torch.float64)
        output.batch["generation_window"] = window.expand(len(output), 2).clone()  # (B, 2)
        output.batch[REPLICA_KEY] = torch.full((len(output),), self.rank, dtype=torch.long)  # (B,)
        return output

    def _check_serving(self) -> None:
        """RuntimeError unless the engine serves weights the actor sent."""
        if self.receiver is not None and self.receiver.serving is not None:
            return
        if self.receiver is None or self.receiver.failure is None:
            raise RuntimeError("generate_sequences before the rollout engine received the actor's weights")
        raise RuntimeError(f"generate_sequences after a failed weight transfer: {self.receiver.failure}")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def generate_request(self, prompt_ids: list[int], sampling, seed: int, max_new_tokens: int):
        """One turn of an agent's trajectory (the driver's router sends it to this rank alone): its
        `Completion`, the version of each token and the prefix-cache counts with it."""
        self._check_serving()
        return self.batches.request(prompt_ids, sampling, seed, max_new_tokens)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def generate_sequences_async(self, prompts: DataProto) -> DataProto:
        """`generate_sequences`, the driver getting a DataProtoFuture at once (one_step mode)."""
        return self.generate_sequences(prompts)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ping(self) -> None:
        """Answers at once while the process lives (the driver's check after a failed transfer)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def health_check(self) -> None:
        """Answers once the engine's event loop runs it, between two decoding steps (stream mode and
        partial rollouts): a busy engine answers soon, a hung one (a step or a load that never
        returns) never does. Elsewhere calls run one at a time, so it answers after the call."""
        if self.batches is not None:
            self.batches.ping().result()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def score_log_probs(self, sequences: list[list[int]]) -> torch.Tensor | None:
        """The engine's log-probs of each sequence's tokens after the first (B, T-1), or None for an
        engine that cannot score (the hf engine)."""
        score = getattr(self.engine, "score_log_probs", None)
        return None if score is None else score(sequences)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def advance_rng_state(self, position: dict) -> None:
        """The engine's sampling position moved up to `position` (the driver's count of generation
        calls, a `SamplingPosition` state), never back (calls the driver did not count keep theirs)."""
        own = SamplingPosition.from_state(self.engine.get_rng_state())
        self.engine.set_rng_state(own.advanced_to(SamplingPosition.from_state(position)).state())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_rng_state(self, path: str) -> None:
        """This engine's sampling position into `path`/rank_<rank>.pt (the checkpoint's rollout
        part), so a resumed run samples alike."""
        torch.save(self.engine.get_rng_state(), Path(path) / f"rank_{self.rank}.pt")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_rng_state(self, path: str) -> dict:
        """The sampling position saved for this rank, if any; the engine's position now."""
        state = Path(path) / f"rank_{self.rank}.pt"
        if state.is_file():  # absent after a change of the rollout pool's size
            self.engine.set_rng_state(torch.load(state, weights_only=True))
        return self.engine.get_rng_state()

    def teardown(self) -> None:
        """Close the transfer group, then stop the engine (last: vLLM's teardown destroys
        torch.distributed's default group)."""
        self._background.shutdown(wait=False, cancel_futures=True)
        if self.batches is not None:
            self.batches.shutdown()
        self._close_receiver()
        if self.engine is not None:
            self.engine.shutdown()
