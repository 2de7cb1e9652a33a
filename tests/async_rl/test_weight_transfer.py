"""Weights from a sender process to rollout engines in other processes over a process group of
their own (gloo, from a TCPStore rendezvous the sender hosts at a port the OS gave it): the engines
then generate exactly what an engine that loaded the same tensors the colocated way generates, and
know the version they serve. A receiver whose engine fails drains the transfer, so the driver gets
its error, not a timeout."""

import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _receiver_failure_worker import GROUP_TIMEOUT_S, version_tensors
from _transfer_worker import VERSIONS, prompts, rollout_cfg, versioned_tensors
from process_group import read_rest, stop_process_tree

from engines.rollout.hf_rollout import HFRolloutEngine
from engines.weight_sync.transfer import ALIGN, pack_bucket, payload_size, unpack_bucket
from hybridflow.utils.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_transfer_worker.py")
FAILURE_WORKER = Path(__file__).with_name("_receiver_failure_worker.py")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("transfer") / "tiny"))


def test_a_packed_bucket_unpacks_bit_identical_at_aligned_offsets():
    bucket = [
        ("a", torch.randn(3, 5)),  # 60 bytes: the next tensor starts at 64
        ("b", torch.randn(7, dtype=torch.float64)[::2]),  # not contiguous
        ("c", torch.randn(3, 3).to(torch.bfloat16)),
        ("d", torch.arange(5)),
    ]
    specs, flat = pack_bucket(bucket)
    assert [spec[3] % ALIGN for spec in specs] == [0, 0, 0, 0]
    assert flat.numel() == payload_size(specs)
    for (name, tensor), (got_name, got) in zip(bucket, unpack_bucket(specs, flat), strict=True):
        assert got_name == name and got.dtype == tensor.dtype
        assert torch.equal(got, tensor)


def worker_env() -> dict[str, str]:
    """This process's environment for a worker script: the repository importable, warnings off."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}


CLOSE_SCRIPT = """
import os, torch
from engines.weight_sync.transfer import WeightSender, sender_store, transfer_group
def threads():
    return len(os.listdir("/proc/self/task"))
torch.ones(1 << 22).add_(1)  # torch's intra-op threads start here, outside the counts
before = threads()
store = sender_store("127.0.0.1")
group = transfer_group("127.0.0.1", store.port, 0, 1, "gloo", store=store)
del store  # the group holds the store's last reference: closing the group ends the store too
sender = WeightSender(group, bucket_mb=1)
sender.send([("w", torch.ones(3))], version=1)
during = threads()
group.close()
after = threads()
try:
    sender.send([("w", torch.ones(3))], version=2)
except RuntimeError as err:
    print(before, during, after, err)
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc/self/task (Linux)")
def test_closing_a_transfer_group_ends_its_threads_and_refuses_a_later_transfer():
    """A group left alive to the interpreter's exit can abort the process in its teardown, so the
    workers close theirs: closing joins the group's threads and store (a process of its own, so
    that no other thread comes or goes) and a transfer after it is refused by name."""
    out = subprocess.run(
        [sys.executable, "-c", CLOSE_SCRIPT],
        capture_output=True,
        text=True,
        env=worker_env(),
    )
    assert out.returncode == 0, out.stderr[-4000:]
    before, during, after, message = out.stdout.strip().split(" ", 3)
    assert int(during) > int(before) and int(after) == int(before)
    assert message == "a weight transfer over a closed transfer group"


def run_transfer(model_dir: str, engines: list[str], out_dir: Path) -> list[dict]:
    """A sender and one receiver process per engine; each receiver's results."""
    size = 1 + len(engines)
    outs = [out_dir / f"receiver_{rank}.pt" for rank in range(1, size)]

    def receivers(port: int) -> list[list]:
        return [
            [sys.executable, WORKER, "receive", str(port), str(size), model_dir, str(rank), engine, out]
            for rank, (engine, out) in enumerate(zip(engines, outs, strict=True), start=1)
        ]

    run_processes([sys.executable, WORKER, "send", str(size), model_dir], receivers, timeout_s=300)
    return [torch.load(out, weights_only=True) for out in outs]


def run_processes(sender: list, receivers: Callable[[int], list[list]], timeout_s: float) -> None:
    """The sender, then the commands `receivers` makes of the port it published (held by its store
    from before it printed it: no other process can take it first), each in a session of its own;
    each must exit 0 within timeout_s."""
    procs = [start(sender)]
    try:
        procs += [start(cmd) for cmd in receivers(published_port(procs[0], timeout_s))]
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout_s)
            assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                stop_process_tree(proc, grace_s=10)
                read_rest(proc)


def start(cmd: list) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=worker_env(),
        start_new_session=True,
    )


def published_port(sender: subprocess.Popen, timeout_s: float) -> int:
    """The port the sender printed as its first line, read byte by byte so that the rest of its
    output stays in the pipe for `communicate`; AssertionError with its output when it exits first
    or prints none within timeout_s."""
    deadline = time.monotonic() + timeout_s
    line = b""
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([sender.stdout], [], [], max(deadline - time.monotonic(), 0))
        byte = os.read(sender.stdout.fileno(), 1) if ready else b""
        if not byte:
            break
        line += byte
    if not line.strip().isdigit():
        stop_process_tree(sender, grace_s=10)
        stdout, stderr = read_rest(sender)
        raise AssertionError(
            f"the sender published no port within {timeout_s} s ({line!r}): {stdout[-2000:]}{stderr[-4000:]}"
        )
    return int(line)


def colocated_engine(model_dir: str, version: int) -> HFRolloutEngine:
    """An hf engine that loaded the version's tensors as the colocated sharding manager does."""
    engine = HFRolloutEngine(model_dir, rollout_cfg("hf"))
    engine.begin_weight_update()
    engine.update_weights(versioned_tensors(model_dir, version))
    engine.end_weight_update()
    engine.flush_cache()
    return engine


@pytest.mark.slow
def test_two_hf_engines_serve_the_transferred_weights(model_dir, tmp_path):
    results = run_transfer(model_dir, ["hf", "hf"], tmp_path)
    expected = colocated_engine(model_dir, VERSIONS[-1]).generate_sequences(prompts())
    untouched = HFRolloutEngine(model_dir, rollout_cfg("hf")).generate_sequences(prompts())
    assert not torch.equal(untouched.batch["rollout_log_probs"], expected.batch["rollout_log_probs"])
    for result in results:
        assert result["served"] == list(VERSIONS)
        assert torch.equal(result["responses"], expected.batch["responses"])
        torch.testing.assert_close(
            result["log_probs"], expected.batch["rollout_log_probs"], atol=1e-5, rtol=0
        )


@pytest.mark.slow
def test_a_vllm_engine_serves_the_transferred_weights(model_dir, tmp_path):
    """vLLM (CPU build) in its own process, reloading in place; its greedy responses and their
    log-probs are the colocated hf engine's (fp32: within kernel rounding)."""
    (result,) = run_transfer(model_dir, ["vllm"], tmp_path)
    expected = colocated_engine(model_dir, VERSIONS[-1]).generate_sequences(prompts())
    assert result["served"] == list(VERSIONS)
    assert torch.equal(result["responses"], expected.batch["responses"])
    torch.testing.assert_close(result["log_probs"], expected.batch["rollout_log_probs"], atol=1e-4, rtol=0)


BEGIN, UPDATE, END, FLUSH = "begin_weight_update", "update_weights", "end_weight_update", "flush_cache"
FAILURES = {  # failing call: the step named, the calls of the failed transfer, the tensors it left loaded
    UPDATE: ("bucket 1 (layers.2.weight .. layers.3.weight)", [BEGIN, UPDATE, UPDATE, END], [0, 1]),
    BEGIN: (BEGIN, [BEGIN], []),
}


def run_failing_transfer(failing_call: str, out_dir: Path) -> tuple[dict, dict]:
    """The sender's and the receiver's results (`_receiver_failure_worker.py`); exiting after
    half the group's timeout fails the test: a sender left waiting would only return at the timeout."""
    sent, received = out_dir / "sender.pt", out_dir / "receiver.pt"

    def receivers(port: int) -> list[list]:
        return [[sys.executable, FAILURE_WORKER, "receive", str(port), failing_call, received]]

    run_processes([sys.executable, FAILURE_WORKER, "send", sent], receivers, timeout_s=GROUP_TIMEOUT_S / 2)
    return torch.load(sent, weights_only=True), torch.load(received, weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("failing_call", [UPDATE, BEGIN])
def test_a_failing_receiver_drains_the_transfer_and_the_driver_gets_its_error(failing_call, tmp_path):
    """The engine raises RuntimeError during version 1 (group timeout 600 s): the sender's sends
    return, `finish_transfer` raises WeightSyncError naming the version, the step and the cause,
    and the engine, holding what it loaded before the failure, serves no version and refuses to
    generate; version 2 then loads in full and is served (the group stays usable)."""
    step, calls, loaded = FAILURES[failing_call]
    start = time.monotonic()
    sent, received = run_failing_transfer(failing_call, tmp_path)
    elapsed = time.monotonic() - start
    print(f"{failing_call} failing: exchange {elapsed:.1f} s, sends {sent['send_seconds']} s")
    assert elapsed < GROUP_TIMEOUT_S / 2  # drained, not waited out
    cause = f"RuntimeError: {failing_call} failed on purpose"
    assert received["failed"]["type"] == "WeightSyncError"
    assert f"weight transfer of policy version 1: {step} raised {cause};" in received["failed"]["message"]
    assert received["failed"]["cause"] == f"RuntimeError('{failing_call} failed on purpose')"
    assert received["serving_after_failure"] is None
    assert received["calls_failed"] == calls
    assert sorted(received["weights_after_failure"]) == [f"layers.{i}.weight" for i in loaded]
    assert received["refusal"].startswith(
        f"generate_sequences after a failed weight transfer: weight transfer of policy version 1: {step}"
    )
    assert received["served"] == 2 and received["calls_good"] == [BEGIN, UPDATE, UPDATE, UPDATE, END, FLUSH]
    for name, tensor in version_tensors(2):
        assert torch.equal(received["weights"][name], tensor)
