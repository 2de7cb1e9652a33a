"""DataProto operation costs on an RL-shaped batch, against a plain memory copy of its tensor bytes.

Batch: 1,024 samples x 2,048 tokens, 8 tensors (4 int64, 4 float32; 96 MiB) and 4 object arrays
(uid and data_source strings, reward_model dicts, raw_prompt message lists). Times are the median
and best of 7 runs, 31 for the Ray rows (the machine is shared). GB/s counts the tensor bytes an
operation produces (views count too, so a zero-copy operation shows a large number). Two baselines
for the same tensor bytes:
`vs_memcpy` divides by a single-threaded memcpy into buffers already touched (lower bound),
`vs_fresh_copy` by a copy into newly allocated memory (`bytes(buffer)`), which is what each copy
a serialiser makes costs, page faults included. An in-band pickle round trip makes two such
copies (dumps into the payload, loads out of it), so ~2 is its floor; out-of-band (Ray, or
`buffer_callback`) makes none.

Before/after rows (docs/dataproto.md): buffers from Ray's object store are read-only. The old
code copied every tensor out of them on receive; now tensors stay in the object store until
`batch` is first read. "before" rows reproduce the old cost by reading `batch` right after the
receive (the same copy of every tensor into fresh memory); "after" rows receive and leave the
tensors in place (a receiver that forwards, slices, concatenates or moves them to a device).
Before and after calls take turns, so load from other processes falls on both alike.
"Ray split" sends `chunk(4)` of the full batch to 4 actors and waits for them (GB/s of tensor
bytes per call). Run: `python -m benchmarks protocol` (starts its own Ray unless one is running).
"""

import pickle
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import ray
import torch

from hybridflow.protocol import DataProto

TITLE = "DataProto operations (1,024 x 2,048 tokens, 8 tensors, 4 object arrays)"
ROWS, TOKENS, REPEATS, ACTORS = 1024, 2048, 7, 4
# The Ray rows wait on other processes' scheduling on a 2-core machine: their median of 7 moved by
# up to 40% between runs (docs/dataproto.md), so they take more calls (each under 0.2 s).
RAY_REPEATS = 31
INT_KEYS = ["input_ids", "attention_mask", "position_ids", "responses"]
FLOAT_KEYS = ["old_log_probs", "ref_log_prob", "advantages", "returns"]


def make_rl_batch(rows: int = ROWS) -> DataProto:
    generator = torch.Generator().manual_seed(0)
    tensors = {k: torch.randint(0, 32_000, (rows, TOKENS), generator=generator) for k in INT_KEYS}  # (B, T)
    tensors |= {k: torch.randn(rows, TOKENS, generator=generator) for k in FLOAT_KEYS}  # (B, T)
    return DataProto.from_single_dict(
        {
            **tensors,
            "uid": [f"prompt-{i // 8}" for i in range(rows)],
            "data_source": ["openai/gsm8k"] * rows,
            "reward_model": [{"style": "rule", "ground_truth": str(i)} for i in range(rows)],
            "raw_prompt": [[{"role": "user", "content": f"question {i}"}] for i in range(rows)],
        },
        meta_info={"temperature": 1.0, "metrics": {"loss": [0.1]}},
    )


def tensor_bytes(data: DataProto) -> int:
    return sum(v.numel() * v.element_size() for v in data.batch.values())


def time_runs(fns: list[Callable[[], object]], repeats: int = REPEATS) -> list[list[float]]:
    """`repeats` times per function, calls taking turns, so load from other processes (the machine
    is shared) falls on each alike; before/after pairs are timed this way."""
    for fn in fns:
        fn()  # warm-up: first-touch page faults and allocator growth
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return times


def memcpy_all(sources: list[np.ndarray], targets: list[np.ndarray]) -> None:
    for src, dst in zip(sources, targets, strict=True):
        np.copyto(dst, src)


def pickle_round_trip(obj: object, protocol: int, out_of_band: bool = False) -> object:
    if not out_of_band:
        return pickle.loads(pickle.dumps(obj, protocol=protocol))
    buffers = []
    payload = pickle.dumps(obj, protocol=protocol, buffer_callback=buffers.append)
    return pickle.loads(payload, buffers=buffers)


def copy_on_receive(data: DataProto) -> DataProto:
    """The receive cost before this change: every tensor copied out of read-only memory."""
    data.batch  # noqa: B018 - reading `batch` makes the copy
    return data


def ray_round_trip(data: DataProto, copy: bool) -> DataProto:
    received = ray.get(ray.put(data))
    return copy_on_receive(received) if copy else received


@ray.remote(num_cpus=0)
class Receiver:
    def take(self, data: DataProto, copy: bool) -> int:
        if copy:
            copy_on_receive(data)
        return len(data)


def ray_split(data: DataProto, receivers: list, copy: bool) -> None:
    ray.get(
        [r.take.remote(part, copy) for r, part in zip(receivers, data.chunk(len(receivers)), strict=True)]
    )


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # actors need not import benchmarks/


def run() -> list[dict]:
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(  # "local": a cluster of its own even when `ray start` left one running
            address="local",
            num_cpus=ACTORS,
            include_dashboard=False,
            configure_logging=False,
            log_to_driver=False,
        )
    try:
        receivers = [Receiver.remote() for _ in range(ACTORS)]
        ray.get([r.take.remote(DataProto(), False) for r in receivers])  # actors started
        return _run(receivers)
    finally:
        if started_here:
            ray.shutdown()


def _run(receivers: list) -> list[dict]:
    data = make_rl_batch()
    nbytes = tensor_bytes(data)
    tensors_only = data.select(non_tensor_batch_keys=[], meta_info_keys=[])
    plain_dict = dict(tensors_only.batch.items())
    sources = [v.numpy() for v in plain_dict.values()]
    targets = [np.empty_like(a) for a in sources]
    chunks8 = data.chunk(8)
    prompts = data[: ROWS // 4]
    inputs = data.select(batch_keys=INT_KEYS)
    outputs = data.select(batch_keys=FLOAT_KEYS, non_tensor_batch_keys=[], meta_info_keys=[])

    flat = np.concatenate([a.view(np.uint8).ravel() for a in sources])
    chunk_bytes = nbytes // 8
    chunk_dict = {k: v[: ROWS // 8] for k, v in plain_dict.items()}
    cases = [
        ("memcpy of tensor bytes (baseline)", nbytes, lambda: memcpy_all(sources, targets)),
        ("copy into fresh memory (baseline)", nbytes, lambda: bytes(memoryview(flat))),
        ("concat 8 chunks", nbytes, lambda: DataProto.concat(chunks8)),
        ("chunk(8) (views)", nbytes, lambda: data.chunk(8)),
        ("union 4 new tensors (no copy)", nbytes, lambda: inputs.select().union(outputs)),
        ("repeat 256 rows x4 interleave", nbytes, lambda: prompts.repeat(4, interleave=True)),
        ("select 4 keys (views)", nbytes // 2, lambda: data.select(batch_keys=INT_KEYS)),
        ("select 4 keys deepcopy", nbytes // 2, lambda: data.select(batch_keys=INT_KEYS, deepcopy=True)),
        ("pickle round trip tensors p5", nbytes, lambda: pickle_round_trip(tensors_only, 5)),
        ("pickle round trip tensors p5 oob", nbytes, lambda: pickle_round_trip(tensors_only, 5, True)),
        ("pickle round trip tensors p4", nbytes, lambda: pickle_round_trip(tensors_only, 4)),
        ("pickle round trip full batch p5", nbytes, lambda: pickle_round_trip(data, 5)),
        ("torch-native pickle dict of tensors p5", nbytes, lambda: pickle_round_trip(plain_dict, 5)),
        ("pickle round trip bare numpy arrays p5 (floor)", nbytes, lambda: pickle_round_trip(sources, 5)),
        ("pickle round trip chunk(8)[0] p5", chunk_bytes, lambda: pickle_round_trip(chunks8[0], 5)),
        # torch pickles a view's whole storage, so one chunk costs as much as the full batch
        ("torch-native pickle of chunk views p5", chunk_bytes, lambda: pickle_round_trip(chunk_dict, 5)),
    ]
    before_after = [
        ("Ray put+get tensors: before (copy on receive)", nbytes, lambda: ray_round_trip(tensors_only, True)),
        ("Ray put+get tensors: after (in place)", nbytes, lambda: ray_round_trip(tensors_only, False)),
        ("Ray split to 4 actors: before (copy on receive)", nbytes, lambda: ray_split(data, receivers, True)),
        ("Ray split to 4 actors: after (in place)", nbytes, lambda: ray_split(data, receivers, False)),
    ]
    for _ in range(3):  # the object store's shared memory is touched for the first time here, not timed
        ray_split(data, receivers, copy=False)
    timed = [(name, moved, time_runs([fn])[0]) for name, moved, fn in cases]
    pair_times = time_runs([fn for _, _, fn in before_after], RAY_REPEATS)
    timed += [(name, moved, t) for (name, moved, _), t in zip(before_after, pair_times, strict=True)]
    # seconds per tensor byte of each baseline, so rows moving fewer bytes compare fairly
    memcpy_per_byte = statistics.median(timed[0][2]) / nbytes
    fresh_copy_per_byte = statistics.median(timed[1][2]) / nbytes
    rows = []
    for name, moved, times in timed:
        seconds = statistics.median(times)
        rows.append(
            {
                "op": name,
                "median_ms": seconds * 1e3,
                "best_ms": min(times) * 1e3,
                "GB_s": moved / seconds / 1e9,
                "vs_memcpy": seconds / (memcpy_per_byte * moved),
                "vs_fresh_copy": seconds / (fresh_copy_per_byte * moved),
            }
        )
    return rows
