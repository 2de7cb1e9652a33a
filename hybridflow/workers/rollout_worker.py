"""The rollout as its own role (trainer.placement=disaggregated): one process per device of the
rollout pool, each holding a rollout engine and nothing of the actor.

Weights arrive over a transfer group (hybridflow/workers/weight_transfer.py) whose sender is the
actor's rank 0. Joining the group and receiving a transfer are collectives with the actor, which
the driver calls one group at a time: so the rollout side runs them in a background thread
(`start_join_transfer` / `start_receive_weights`) and the driver collects the outcome with
`finish_transfer` after the actor's side returned. Every generated sample carries
`policy_version` (B,): the version of the weights its engine served, and `generation_window`
(B, 2): the wall-clock start and end of the call that generated it (the async loop's overlap).
Checkpoints hold each engine's sampling position (`save_rng_state`), as the colocated worker's do.
"""

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from hybridflow.config.schema import RecipeConfig
from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Worker, register


class RolloutWorker(Worker):
    def __init__(self, config: RecipeConfig):
        self.config = config
        self.engine = None
        self.receiver = None
        self._background = ThreadPoolExecutor(max_workers=1)
        self._pending: Future | None = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from engines.rollout.base import create_rollout_engine

        cfg = self.config
        if cfg.rollout.tensor_model_parallel_size != 1:
            raise ValueError(
                "trainer.placement=disaggregated runs one engine per rollout process for now: set "
                f"rollout.tensor_model_parallel_size=1, got {cfg.rollout.tensor_model_parallel_size}"
            )
        self.engine = create_rollout_engine(cfg.rollout, cfg.model.path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def start_join_transfer(self, host: str, port: int, size: int) -> None:
        """Join the transfer group as member 1 + this rank (in the background)."""
        from hybridflow.workers.weight_transfer import WeightReceiver, transfer_group

        backend = "nccl" if torch.cuda.is_available() else "gloo"

        def join() -> None:
            self.receiver = WeightReceiver(transfer_group(host, port, 1 + self.rank, size, backend))

        self._start(join)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def start_receive_weights(self) -> None:
        """Receive the next transfer into the engine (in the background)."""
        self._start(lambda: self.receiver.load_into(self.engine))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def finish_transfer(self):
        """Wait for the background join or transfer; its result (the version served), or its error."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("finish_transfer without a started join or transfer")
        return pending.result()

    def _start(self, work) -> None:
        if self._pending is not None:
            raise RuntimeError("a weight transfer is already under way on this rollout worker")
        self._pending = self._background.submit(work)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Responses to this rank's prompts, each with the `policy_version` (B,) that produced it."""
        if self.receiver is None or self.receiver.serving is None:
            raise RuntimeError("generate_sequences before the rollout engine received the actor's weights")
        start = time.time()  # wall clock: compared with the driver's (hybridflow/trainer/async_loop.py)
        output = self.engine.generate_sequences(prompts)
        window = torch.tensor([start, time.time()], dtype=torch.float64)
        output.batch["policy_version"] = torch.full((len(output),), self.receiver.serving, dtype=torch.long)
        output.batch["generation_window"] = window.expand(len(output), 2).clone()  # (B, 2)
        return output

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def generate_sequences_async(self, prompts: DataProto) -> DataProto:
        """`generate_sequences`, the driver getting a DataProtoFuture at once (one_step mode)."""
        return self.generate_sequences(prompts)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_rng_state(self, path: str) -> None:
        """This engine's sampling position into `path`/rollout, so a resumed run samples alike."""
        rollout_dir = Path(path) / "rollout"
        rollout_dir.mkdir(parents=True, exist_ok=True)
        torch.save(self.engine.get_rng_state(), rollout_dir / f"rank_{self.rank}.pt")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_rng_state(self, path: str) -> None:
        state = Path(path) / "rollout" / f"rank_{self.rank}.pt"
        if state.is_file():  # absent after a change of the rollout pool's size
            self.engine.set_rng_state(torch.load(state, weights_only=True))

    def teardown(self) -> None:
        """Stop the engine (last: vLLM's teardown destroys torch.distributed's default group)."""
        self._background.shutdown(wait=False, cancel_futures=True)
        if self.engine is not None:
            self.engine.shutdown()
