"""Weights from the actor to rollout engines in other processes (trainer.placement=disaggregated).

The actor's rank that holds full tensors (rank 0 of the actor's job, which the colocated weight
stream `engines.megatron.weights.iter_hf_tensors` already gives every rank) and the rollout
engines form a process group of their own: a TCPStore rendezvous hosted by the sender, then a
gloo (CPU) or NCCL (CUDA) group built on it directly. It is not the default group (the actor's
Megatron world and each engine's world stay as they are) and it never enters torch.distributed's
group registry, so nothing else can reach it by accident.

One transfer is a sequence of broadcasts from rank 0, one header and one payload per bucket:

    header  (pickled)  {"version": v, "tensors": [(name, shape, dtype, offset), ...]}
    payload (uint8)    the bucket's tensors' bytes, each at a 16-byte-aligned offset
    ...
    header             {"version": v, "tensors": None}: the transfer is over

With delta transfers (`delta_dtype`, rollout.weight_sync_delta), each transfer starts with an
all-gather of the version every member's `DeltaBase` is complete for (-1: none, as after a
restart); when every receiver holds the sender's, each tensor goes as its changed elements against
that base, else every tensor goes whole (engines/weight_sync/delta.py). Such a header also carries
each tensor's entry (name, shape, dtype, checksum of the new tensor, kind), the payload its
positions and values; the receiver rebuilds each tensor from its copy, checks it against the
checksum, and loads it whole into its engine.

Buckets are those of the colocated sync (`bucket_named_tensors`, `rollout.weight_sync_bucket_mb`).
Each receiver loads the buckets into its engine inside one weight-update session (the engine's own
load path, as the colocated sync does) and then serves policy version v. A receiver
whose engine fails still receives the rest of the transfer, so the sender returns and the driver
gets the receiver's error (WeightSyncError, from the rollout worker's `finish_transfer`) instead of
a collective timeout; that engine then serves no known version until a transfer succeeds.
A failure of the transfer itself (a member died: its connections closed) breaks the collective for
every member, so the member that meets it closes its end at once: the members waiting on it fail
in turn instead of blocking until the group's timeout, and every end of the broken group is
closed within moments (the driver then rebuilds it).

    store = sender_store(host)  # listening from now on; tell the receivers store.port
    group = transfer_group(host, store.port, 0, 1 + engines, "gloo", store=store)
    sender = WeightSender(group, bucket_mb=512)
    sender.send(iter_hf_tensors(chunks, hf_config), version=step)
    receiver = WeightReceiver(transfer_group(host, store.port, rank, 1 + engines, "gloo"))
    receiver.load_into(engine)  # -> the policy version the engine now serves, or WeightSyncError
"""

import pickle
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engines.weight_sync.common import WeightSyncError, bucket_named_tensors, tensor_nbytes
from engines.weight_sync.delta import DeltaBase, DeltaStats, pack_deltas, unpack_deltas

ALIGN = 16  # bytes: every tensor of a payload starts at a multiple, so its dtype view is aligned
SENDER = 0
BACKENDS = ("gloo", "nccl")


@dataclass
class TransferGroup:
    """A process group outside torch.distributed's registry, with the store it was built on."""

    store: dist.Store | None
    group: dist.ProcessGroup | None
    rank: int
    size: int
    device: torch.device

    def close(self) -> None:
        """Destroy the group now: its threads join and its connections close. `shutdown` is what
        torch's destroy_process_group calls on each group (NCCL's communicators end there); gloo's
        leaves its threads running and its broadcasts working (torch 2.13, measured), and only
        dropping the last reference ends them. A group still alive when the interpreter exits can
        abort the process in its teardown ("terminate called without an active exception",
        pytorch/pytorch#190489); a traceback kept by a failed transfer can hold this object, not
        the group, so the group ends here."""
        if self.group is not None:
            self.group.shutdown()
        self.group = self.store = None


def sender_store(host: str, timeout_s: float = 600.0) -> dist.TCPStore:
    """The sender's rendezvous store, listening on `host` from now on at a port the OS gave it
    (`.port`): publish that port to the receivers and pass the store to `transfer_group`. (A port
    found free and closed again can be taken by another process before the sender binds it.)"""
    timeout = timedelta(seconds=timeout_s)
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)


def transfer_group(
    host: str,
    port: int,
    rank: int,
    size: int,
    backend: str,
    timeout_s: float = 600.0,
    store: dist.TCPStore | None = None,
) -> TransferGroup:
    """Collective over the `size` members, who meet at the TCPStore that rank 0 (the sender) hosts
    at host:port: `store` from `sender_store` on rank 0 (without it rank 0 binds host:port here).
    gloo moves host tensors; nccl moves tensors of this process's current CUDA device."""
    if backend not in BACKENDS:
        raise ValueError(f"weight transfer backend must be one of {BACKENDS}, got {backend!r}")
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, size, is_master=rank == SENDER, timeout=timeout)
    store = dist.PrefixStore("weight_transfer", store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(store, rank, size, timeout)
        device = torch.device("cpu")
    else:
        group = dist.ProcessGroupNCCL(store, rank, size)
        device = torch.device("cuda", torch.cuda.current_device())
    return TransferGroup(store, group, rank, size, device)


def pack_bucket(bucket: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple], torch.Tensor]:
    """The tensors' specs (name, shape, dtype name, byte offset) and their bytes in one flat
    buffer, each tensor at an ALIGN-byte boundary. -> (specs, (N,) uint8)"""
    specs, offset = [], 0
    for name, tensor in bucket:
        specs.append((name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), offset))
        offset = _aligned(offset + tensor_nbytes(tensor))
    flat = torch.zeros(offset, dtype=torch.uint8, device=bucket[0][1].device)  # (N,)
    for (_, _, _, start), (_, tensor) in zip(specs, bucket, strict=True):
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)  # (nbytes,)
        flat[start : start + raw.numel()] = raw
    return specs, flat


def unpack_bucket(specs: list[tuple], flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The inverse of `pack_bucket`: views into `flat`, no copy."""
    bucket = []
    for name, shape, dtype_name, start in specs:
        dtype = getattr(torch, dtype_name)
        nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        bucket.append((name, flat[start : start + nbytes].view(dtype).view(shape)))
    return bucket


def payload_size(specs: list[tuple]) -> int:
    """Bytes of the flat buffer `pack_bucket` makes for these specs."""
    _, shape, dtype_name, start = specs[-1]
    element = torch.empty(0, dtype=getattr(torch, dtype_name)).element_size()
    return _aligned(start + torch.Size(shape).numel() * element)


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


class WeightSender:
    """Rank 0 of a transfer group: broadcasts the actor's named tensors, bucket by bucket."""

    def __init__(self, group: TransferGroup, bucket_mb: float, delta_dtype: torch.dtype | None = None):
        if group.rank != SENDER:
            raise ValueError(f"the weight sender is rank {SENDER} of its transfer group, not {group.rank}")
        self.group = group
        self.bucket_mb = bucket_mb
        self.base = None if delta_dtype is None else DeltaBase(delta_dtype)  # what it last sent
        self.stats = DeltaStats()  # of the last transfer

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """Every tensor of the stream to every receiver, as policy `version`; the bytes sent. When a
        broadcast fails, the group is closed and the rest of the stream drained (its gathers need
        every model-parallel rank) before the error is raised."""
        self.stats = DeltaStats()
        stream = iter(named_tensors)
        try:
            self._send_all(stream, version)
        except Exception:
            self.group.close()  # the receivers waiting on this end fail now, not at the timeout
            for _ in stream:
                pass
            raise
        return self.stats.sent_bytes

    def _send_all(self, named_tensors: Iterator[tuple[str, torch.Tensor]], version: int) -> None:
        if self.base is not None:
            self._send_deltas(named_tensors, version)
        else:
            for bucket in bucket_named_tensors(named_tensors, self.bucket_mb):
                for _, tensor in bucket:
                    self.stats.add_whole(tensor)
                self._send_bucket(version, bucket, {})
        _broadcast_object(self.group, {"version": version, "tensors": None})

    def _send_deltas(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Each tensor as its changed elements against what every receiver holds, or whole."""
        held = _gather_versions(self.group, self.base.version)[1:]
        against_base = self.base.version is not None and all(v == self.base.version for v in held)
        self.base.version = None  # until this transfer is sent in full
        for bucket in bucket_named_tensors(named_tensors, self.bucket_mb):
            deltas = [(name, self.base.encode(name, tensor, against_base)) for name, tensor in bucket]
            for _, delta in deltas:
                self.stats.add(delta)
            entries, parts = pack_deltas(deltas)
            self._send_bucket(version, [("", part) for part in parts], {"deltas": entries})
        self.base.version = version

    def _send_bucket(self, version: int, bucket: list[tuple[str, torch.Tensor]], extra: dict) -> None:
        """One header (with `extra`), then the tensors' payload unless there are none."""
        moved = [(name, tensor.to(self.group.device)) for name, tensor in bucket]
        specs, flat = pack_bucket(moved) if moved else ([], None)
        _broadcast_object(self.group, {"version": version, "tensors": specs, **extra})
        if flat is not None:
            _broadcast(self.group, flat)


class WeightReceiver:
    """A rollout engine's end of a transfer group."""

    def __init__(self, group: TransferGroup, delta_dtype: torch.dtype | None = None):
        if group.rank == SENDER:
            raise ValueError(f"rank {SENDER} of a transfer group sends; receivers are 1..{group.size - 1}")
        self.group = group
        self.base = None if delta_dtype is None else DeltaBase(delta_dtype)  # what it last loaded
        self.version: int | None = None  # of the transfer under way (once a header came) or last received
        self.serving: int | None = None  # the version the engine holds in full; None after a failure
        self.failure: WeightSyncError | None = None  # the last transfer's error; None after a success
        self.header: dict = {}  # of the bucket last received

    def receive(self) -> Iterator[tuple[list[tuple], torch.Tensor | None]]:
        """The buckets of one transfer, in order, as they arrive: (specs, (N,) uint8 payload), the
        payload None for a delta bucket whose tensors all stayed the same; `header` is the bucket's."""
        while True:
            self.header = _broadcast_object(self.group, None)
            self.version = self.header["version"]
            specs = self.header["tensors"]
            if specs is None:
                return
            flat = None
            if specs:
                flat = torch.empty(payload_size(specs), dtype=torch.uint8, device=self.group.device)
                _broadcast(self.group, flat)
            yield specs, flat

    def load_into(self, engine) -> int:
        """One transfer into `engine` through its own load path (a weight-update session, then its
        cache flushed); returns the policy version it now serves.

        Whatever a step raises (`begin_weight_update`, a bucket's `update_weights`, e.g. an
        out-of-memory in vLLM's layerwise reload, `end_weight_update`, `flush_cache`), the rest of
        the transfer is still received and dropped, so the sender's broadcasts complete and the
        group stays usable; the session is closed if it was opened; then WeightSyncError names the
        version, the bucket or call that failed and the cause (chained). Buckets loaded before the
        failure stay loaded: the engine holds a mix of versions, so `serving` is None until a
        transfer succeeds. A failure of the transfer itself (a collective of the group, a receive
        buffer's allocation) cannot be drained: the group is unusable, so it is closed at once (the
        members waiting on this end fail too), and the error raises the same way.
        """
        self.version = None
        steps = _FirstFailure()
        opened = steps.run("begin_weight_update", engine.begin_weight_update)
        if not steps.run("receiving the transfer", self._load_buckets, engine, steps):
            self.group.close()  # unusable: the members waiting on this end fail now, not at the timeout
        if opened:
            steps.run("end_weight_update", engine.end_weight_update)
        if steps.error is None:
            steps.run("flush_cache", engine.flush_cache)
        self.failure = steps.failure(self.version)
        if self.failure is not None:
            self.serving = None
            raise self.failure from steps.error
        self.serving = self.version
        if self.base is not None:
            self.base.version = self.serving
        return self.serving

    def _load_buckets(self, engine, steps: "_FirstFailure") -> None:
        """Each bucket into `engine` until a step fails; the buckets after that are only received."""
        if self.base is not None:  # complete again only once this transfer is loaded in full
            held, self.base.version = self.base.version, None
            _gather_versions(self.group, held)
        for index, (specs, flat) in enumerate(self.receive()):
            if steps.error is None:
                names = [entry[0] for entry in self.header.get("deltas", specs)]
                step = f"bucket {index} ({names[0]} .. {names[-1]})"
                steps.run(step, self._load_bucket, engine, specs, flat, self.header.get("deltas"))

    def _load_bucket(self, engine, specs: list[tuple], flat: torch.Tensor | None, entries: list | None):
        """A bucket's tensors into `engine`; a delta bucket's (`entries`) rebuilt from this receiver's
        copy first, each checked against the sender's checksum (`DeltaBase.decode`)."""
        received = unpack_bucket(specs, flat) if flat is not None else []
        if entries is None:
            engine.update_weights(received)
            return
        if self.base is None:
            raise WeightSyncError("a delta transfer reached a receiver without rollout.weight_sync_delta")
        deltas = unpack_deltas(entries, [tensor.cpu() for _, tensor in received])  # the copy is on the CPU
        engine.update_weights([(name, self.base.decode(name, delta)) for name, delta in deltas])


class _FirstFailure:
    """The steps of one transfer: each runs; the first to raise is the transfer's failure."""

    def __init__(self):
        self.step = ""
        self.error: Exception | None = None

    def run(self, step: str, call: Callable, *args) -> bool:
        """call(*args); whether it returned. A later failure is noted on the first one."""
        try:
            call(*args)
        except Exception as err:  # any: the sender waits on every broadcast of the transfer
            if self.error is None:
                self.step, self.error = step, err
            else:
                self.error.add_note(f"then {step} raised {type(err).__name__}: {err}")
            return False
        return True

    def failure(self, version: int | None) -> WeightSyncError | None:
        """The transfer's error, None when every step returned."""
        if self.error is None:
            return None
        return WeightSyncError(
            f"weight transfer of policy version {version}: {self.step} raised "
            f"{type(self.error).__name__}: {self.error}; what was loaded before it stays loaded, so "
            "the engine serves no known version until a transfer succeeds"
        )


def _broadcast(group: TransferGroup, tensor: torch.Tensor) -> None:
    if group.group is None:
        raise RuntimeError("a weight transfer over a closed transfer group")
    group.group.broadcast([tensor], dist.BroadcastOptions()).wait()


def _gather_versions(group: TransferGroup, version: int | None) -> list[int]:
    """Every member's version (None as -1), in rank order: what each one's `DeltaBase` holds."""
    mine = torch.tensor([-1 if version is None else version], dtype=torch.int64, device=group.device)
    every = [torch.empty_like(mine) for _ in range(group.size)]
    if group.group is None:
        raise RuntimeError("a weight transfer over a closed transfer group")
    group.group.allgather([every], [mine]).wait()
    return [int(v.item()) for v in every]


def _broadcast_object(group: TransferGroup, obj):
    """`obj` from the sender to every member (receivers pass None): a length, then pickled bytes."""
    data = pickle.dumps(obj) if group.rank == SENDER else b""
    length = torch.tensor([len(data)], dtype=torch.int64, device=group.device)
    _broadcast(group, length)
    buffer = torch.empty(int(length.item()), dtype=torch.uint8, device=group.device)
    if group.rank == SENDER:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    _broadcast(group, buffer)
    return pickle.loads(buffer.cpu().numpy().tobytes()) if group.rank != SENDER else obj
