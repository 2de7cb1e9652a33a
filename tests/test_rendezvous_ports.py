"""The rendezvous ports a run publishes are already held by their store when published.

A port chosen by binding port 0 and closing the socket is free until the store binds it: any other
process on the node (another run, a test, the OS handing out an ephemeral port) can take it in
between, and the group then fails to start (EADDRINUSE on rank 0, the other ranks connecting to a
stranger). Each test takes the published port the way such a process would, if it is still free,
and then starts the group on it.
"""

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from single_controller_workers import ProbeWorker

from engines.weight_sync.transfer import WeightReceiver, transfer_group, unpack_bucket
from hybridflow.single_controller import (
    LocalWorkerGroup,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
)
from hybridflow.workers.transfer_policy import TransferPolicyWorker

SPMD_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# The receiver's wait for the sender's store: long enough for a loaded machine; on failure the
# test closes what the receiver waits on, so it ends at once rather than at this deadline.
RECEIVER_TIMEOUT_S = 120.0


@contextmanager
def racer_on(port: int) -> Iterator[None]:
    """Another process's listening socket on `port`, if the port is still free to take."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
            sock.listen()
        except OSError:
            pass  # the port is held (by the store that published it)
        yield


@pytest.fixture
def spmd_env_restored(monkeypatch):
    """LocalWorkerGroup sets the SPMD variables in this process; monkeypatch restores them after."""
    for key in SPMD_KEYS:
        monkeypatch.delenv(key, raising=False)


def test_a_ray_worker_group_starts_torch_distributed_on_its_published_port(ray_cluster):
    pool = RayResourcePool([2], name_prefix="test_rendezvous_ports")
    group = RayWorkerGroup(pool, RayClassWithInitArgs(ProbeWorker, "racer"))
    try:
        ports = {env["MASTER_PORT"] for env in group.env()}
        assert len(ports) == 1
        with racer_on(int(ports.pop())):
            assert group.all_reduce_rank_plus_one() == [3.0, 3.0]
    finally:
        group.shutdown()
        pool.release()


def test_a_local_worker_group_starts_torch_distributed_on_its_published_port(spmd_env_restored):
    local = LocalWorkerGroup(ray_cls_with_init=RayClassWithInitArgs(ProbeWorker, "racer"))
    (env,) = local.env()
    try:
        with racer_on(int(env["MASTER_PORT"])):
            assert local.all_reduce_rank_plus_one() == [1.0]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_weight_transfer_group_starts_on_the_address_the_sender_published(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    rollout = SimpleNamespace(weight_sync_bucket_mb=1.0, weight_sync_delta=False)
    sender = TransferPolicyWorker(SimpleNamespace(rollout=rollout))
    host, port = sender.transfer_address()
    received, receiver_error = [], []

    def receive() -> None:
        try:
            receiver = WeightReceiver(transfer_group(host, port, 1, 2, "gloo", timeout_s=RECEIVER_TIMEOUT_S))
            received.extend(
                (name, t.clone())
                for specs, flat in receiver.receive()
                for name, t in unpack_bucket(specs, flat)
            )
            receiver.group.close()
        except Exception as error:  # reported by the main thread
            receiver_error.append(error)

    with racer_on(port):
        thread = threading.Thread(target=receive, daemon=True)
        thread.start()
        try:
            sender.join_transfer(host, port, 2)
            sender.sender.send([("w", torch.arange(4.0))], version=7)
        finally:
            sender.leave_transfer()
    thread.join(timeout=RECEIVER_TIMEOUT_S)
    assert not thread.is_alive(), "the receiver did not finish"
    assert not receiver_error, receiver_error
    assert [(name, t.tolist()) for name, t in received] == [("w", [0.0, 1.0, 2.0, 3.0])]
