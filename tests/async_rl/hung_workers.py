"""Rollout-worker stand-ins for test_hung_engines.py, whose engines can hang (test code only).

`SteppingRollout` runs its generation calls as the real rollout worker does in stream mode: as
coroutines on one event loop in a thread of its own, each step blocking the loop (a decoding step)
and the calls taking turns between steps; `health_check` answers once the loop runs it, between
two steps, as the real worker's does (hybridflow/workers/rollout_worker.py). A call's rows say how it runs
(`meta_info["steps"]`: that many steps; `HANG`: its first step never returns), and a call with
`meta_info["hang_once"]` hangs in the first process of the run that takes it (the marker file in
`folder` records it), so the call generated again on a restarted process finishes. The transfer
methods take part in a pool's transfers as no-ops serving version 0 (`finish_transfer` never
returns once `folder`/hang_transfer exists).

Ray workers cannot import tests/ modules: this module's classes travel by value (cloudpickle).
"""

import asyncio
import os
import sys
import threading
import time
from pathlib import Path

import ray
import torch

from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Worker, register

HANG = -1
STEP_S = 0.05  # one simulated decoding step


async def decoding(steps: int, never: threading.Event) -> None:
    """`steps` decoding steps, each blocking the loop (HANG: one that never returns). Not a method:
    an actor class with a coroutine method would be run by Ray as an async actor, on one loop."""
    for _ in range(max(steps, 1)):
        never.wait(None if steps == HANG else STEP_S)
        await asyncio.sleep(0)  # the other calls' steps, and a health check, go between


class SteppingRollout(Worker):
    def __init__(self, folder: str):
        self.folder = Path(folder)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.never = threading.Event()  # a hung step waits for it: nothing sets it

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        pass

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, rows: DataProto) -> DataProto:
        start = time.time()
        steps = rows.meta_info.get("steps", 1)
        if rows.meta_info.get("hang_once") and self._first_to_hang():
            steps = HANG
        asyncio.run_coroutine_threadsafe(decoding(steps, self.never), self.loop).result()
        out = DataProto.from_dict({"x": rows.batch["x"].clone()})
        out.batch["policy_version"] = torch.zeros(len(out), dtype=torch.long)  # (B,)
        out.batch["generation_window"] = torch.tensor([[start, time.time()]]).expand(len(out), 2).clone()
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def generate_sequences_async(self, rows: DataProto) -> DataProto:
        return self.generate_sequences(rows)

    def _first_to_hang(self) -> bool:
        try:
            (self.folder / "hung").touch(exist_ok=False)
        except FileExistsError:
            return False
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def health_check(self) -> None:
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self.loop).result()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def start_join_transfer(self, host: str, port: int, size: int) -> None:
        pass

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def start_receive_weights(self) -> None:
        pass

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def finish_transfer(self) -> int:
        if (self.folder / "hang_transfer").exists():  # a load that never returns
            self.never.wait()
        return 0

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def leave_transfer(self) -> None:
        pass

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def ping(self) -> None:
        pass

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def score_log_probs(self, sequences: list[list[int]]) -> None:
        return None  # an engine that cannot score, as the hf engine


class HangingWorker(Worker):
    """A trainer-side worker whose `hang_on(rank)` never returns on that rank."""

    def __init__(self):
        self.never = threading.Event()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def hang_on(self, rank: int) -> int:
        if self.rank == rank:
            self.never.wait()
        return self.rank


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
