"""One end of a weight transfer whose receiver fails (test_weight_transfer.py), run as its own process:

    python tests/async_rl/_receiver_failure_worker.py send    OUT_FILE
    python tests/async_rl/_receiver_failure_worker.py receive PORT FAILING_CALL OUT_FILE

The sender hosts the group's store at a port the OS gave it and prints that port as its first line
of output (the receiver's PORT). It sends policy versions 1 and 2 of `version_tensors` (3 buckets
each) and writes the seconds each `send` took. The receiver is a `RolloutWorker` whose engine is
an `EngineDouble` raising RuntimeError in FAILING_CALL during version 1; it takes each transfer as
the driver makes it (`PoolRollout.sync_weights`: start the receive, the actor's send returns, then
`finish_transfer`) and writes what it saw: the error, the engine's state and calls, its refusal to
generate, and the version served after the second transfer.
"""

import os
import sys
import time
from types import SimpleNamespace

import torch

from engines.rollout.config import RolloutConfig
from engines.weight_sync.transfer import WeightSender, sender_store, transfer_group
from hybridflow.workers.rollout_worker import RolloutWorker

HOST = "127.0.0.1"
GROUP_TIMEOUT_S = 600.0  # transfer_group's default, which the rollout worker's group has
BUCKET_MB = 0.02  # 20,971 bytes: two 8 KiB tensors a bucket, not three
NAMES = [f"layers.{i}.weight" for i in range(6)]
VERSIONS = (1, 2)
FAILS_AT = {"begin_weight_update": 1, "update_weights": 2}  # the n-th call fails; update: the 2nd bucket


def version_tensors(version: int) -> list[tuple[str, torch.Tensor]]:
    """Policy `version`'s tensors: tensor i is (32, 64) float32 filled with version + i / 10."""
    return [(name, torch.full((32, 64), version + i / 10)) for i, name in enumerate(NAMES)]


class EngineDouble:
    """Stands for a rollout engine (`RolloutEngine`, engines/rollout/base.py) in the weight-update
    calls `WeightReceiver.load_into` makes (begin_weight_update, update_weights, end_weight_update,
    flush_cache) and in the teardown's `shutdown`. Records each weight-update call and keeps the
    tensors loaded; `failing_call` raises RuntimeError once, at its FAILS_AT-th call."""

    def __init__(self, failing_call: str):
        self.failing_call = failing_call
        self.calls: list[str] = []
        self.weights: dict[str, torch.Tensor] = {}

    def begin_weight_update(self) -> None:
        self._call("begin_weight_update")

    def update_weights(self, named_tensors) -> None:
        self._call("update_weights")
        self.weights.update((name, tensor.clone()) for name, tensor in named_tensors)

    def end_weight_update(self) -> None:
        self._call("end_weight_update")

    def flush_cache(self) -> None:
        self._call("flush_cache")

    def shutdown(self) -> None:
        """The worker's teardown stops its engine; this one holds nothing to stop."""

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name == self.failing_call and self.calls.count(name) == FAILS_AT[name]:
            self.failing_call = None  # once: the next transfer succeeds
            raise RuntimeError(f"{name} failed on purpose")


def send(out_file: str) -> None:
    store = sender_store(HOST, timeout_s=GROUP_TIMEOUT_S)
    print(store.port, flush=True)  # held by the store from now on: the receiver meets there
    group = transfer_group(HOST, store.port, 0, 2, "gloo", timeout_s=GROUP_TIMEOUT_S, store=store)
    sender = WeightSender(group, bucket_mb=BUCKET_MB)
    seconds = []
    for version in VERSIONS:
        start = time.monotonic()
        sender.send(version_tensors(version), version)
        seconds.append(time.monotonic() - start)
        group.store.set(f"sent {version}", "")
    torch.save({"send_seconds": seconds}, out_file)
    group.store.wait(["received"])  # the store lives in this process: keep it for the receiver
    group.close()


def receive(port: int, failing_call: str, out_file: str) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1")  # the rollout pool's only process
    # the rollout defaults (full transfers, no deltas); the engine is set below, not by init_model
    worker = RolloutWorker(config=SimpleNamespace(rollout=RolloutConfig()))
    worker.engine = engine = EngineDouble(failing_call)
    worker.start_join_transfer(HOST, port, 2)
    worker.finish_transfer()
    result = {"failed": transfer(worker, 1), "serving_after_failure": worker.receiver.serving}
    result |= {"weights_after_failure": dict(engine.weights), "calls_failed": list(engine.calls)}
    result["refusal"] = refusal(worker)
    engine.calls.clear()
    result |= {"served": transfer(worker, 2), "calls_good": engine.calls, "weights": engine.weights}
    torch.save(result, out_file)
    worker.receiver.group.store.set("received", "")
    worker.teardown()  # as the worker group ends a worker: its transfer group closes before the exit


def transfer(worker: RolloutWorker, version: int):
    """One transfer in the driver's order: the version served, or finish_transfer's error as a dict
    (type, message, repr of its cause)."""
    worker.start_receive_weights()
    worker.receiver.group.store.wait([f"sent {version}"])  # the actor's send_weights returned
    try:
        return worker.finish_transfer()
    except Exception as err:
        return {"type": type(err).__name__, "message": str(err), "cause": repr(err.__cause__)}


def refusal(worker: RolloutWorker) -> str:
    try:
        worker.generate_sequences(None)  # refused before it reads the prompts
    except RuntimeError as err:
        return str(err)
    raise AssertionError("generate_sequences ran on an engine serving no known version")


if __name__ == "__main__":
    if sys.argv[1] == "send":
        send(sys.argv[2])
    else:
        receive(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    print(f"OK {sys.argv[1]}", flush=True)
