"""vLLM (CPU build) against the hf engine: generation tokens/s, and weight sync into vLLM.

Generation: the same 64 prompts (32 tokens) on the tiny quickstart model and on a 76M-parameter
Qwen2 shape (hidden 768, 12 layers, 12 heads of 64, 4 KV heads, random init), fp32 and, where the
CPU has AVX512-BF16, bf16. Each request has its own length limit, drawn log-normal like
bench_megatron's (median 39, log-std 1, capped at 256), and ignores EOS, so both engines produce
the same useful tokens: vLLM stops each request at its limit; `generate` runs the whole batch to
its longest limit (that is how the hf engine serves a batch). tokens/s counts useful tokens. Each
engine runs in a fresh process with the same threads (GENERATION_THREADS, printed) and a short
warm-up call (4 prompts, 8 tokens) before its one timed call; the engines alternate over REPEATS
rounds (hf vllm hf vllm ...), and each row gives the median, the spread ((max - min) / median) and
the ratio of medians to hf, which is refused when the machine's load moved during the rounds
(benchmarks/_conditions.py; the load samples are printed). On the 76M shape vLLM runs twice: with
its linears prepacked for oneDNN (`rollout.vllm_cpu_weights: packed`, the default) and on plain
weights (`plain`). "of matmul peak": the FLOPs each engine achieves (2 per parameter per useful
token; attention left out) against a 2048-square matmul on the same threads and dtype.

Weight sync: the 76M shape held by a Megatron actor at TP1 (1 process) and TP2 (2 gloo processes,
torchrun), synced into each rank's vLLM engine by `MegatronRolloutShardingManager.load_weights`
(512 MiB buckets), with packed weights (vLLM's layerwise reload, which re-packs every layer) and
with plain ones (loaded in place); against a plain copy of the same bytes into preallocated
tensors. After a warm-up of each, syncs and copies alternate over SYNC_REPEATS rounds, each timed
from a barrier of the ranks (at TP2 both ranks copy at once, as both sync at once); each row gives
the median, the spread and the load samples, and the share of a plain copy's rate is refused
when the load moved (as the generation ratios are).

Run: `python -m benchmarks vllm`; the weight-sync rows alone: `python -m benchmarks.bench_vllm sync`.
With BENCH_SYNC_PROFILE=PREFIX each sync worker also profiles one more sync (cProfile, rank 0) into
PREFIX.tp<N>.<weights>.txt.
"""

import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._conditions import LOAD_LIMIT, LoadSamples, alternating, ratio_text, summary
from benchmarks._timing import REPO_ROOT, median_seconds, run_torchrun

TITLE = "vLLM (CPU build) vs hf: generation with heavy-tailed lengths, weight sync into vLLM"
REPEATS = 3
# The TP2 syncs' median of 3 moved by up to 45% between idle runs (spreads up to 27% inside a run,
# 2026-11-29, docs/engines.md); a sync takes under a second, so more rounds settle it cheaply.
SYNC_REPEATS = 9
SHAPE_76M = dict(
    hidden_size=768,
    num_layers=12,
    num_heads=12,
    num_kv_heads=4,
    intermediate_size=2048,
    max_position_embeddings=512,
    init_std=0.02,
)
PROMPTS, PROMPT_LEN, MAX_NEW, MEDIAN_NEW, SIGMA = 64, 32, 256, 39.0, 1.0
GENERATION_THREADS = 2  # both cores for the one engine process, hf and vLLM alike


def run() -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        big = _make_model(tmp / "m76", **SHAPE_76M)
        rows = []
        dtypes = ["float32", "bfloat16"] if _cpu_has_bf16() else ["float32"]
        for model_dir, label in ((_make_model(tmp / "tiny"), "tiny"), (big, "76M")):
            for dtype in dtypes if label == "76M" else ["float32"]:
                rows += _generation_rows(model_dir, label, dtype)
        rows += _sync_rows(big, tmp)
    return rows


def _sync_rows(model_dir: Path, tmp: Path) -> list[dict]:
    """The weight-sync rows: actor TP1 and TP2, packed and plain weights (torchrun each)."""
    rows = []
    for nproc in (1, 2):
        for weights in ("packed", "plain"):
            result = tmp / f"sync{nproc}{weights}.json"
            what = f"vllm sync benchmark at TP{nproc} ({weights} weights)"
            run_torchrun(__file__, nproc, model_dir, result, weights, what=what)
            rows += json.loads(result.read_text())
    return rows


def _sync_only() -> None:
    """`python -m benchmarks.bench_vllm sync`: the weight-sync rows alone (about 1.5 minutes)."""
    from benchmarks.__main__ import _format_table

    with tempfile.TemporaryDirectory() as tmp:
        rows = _sync_rows(_make_model(Path(tmp) / "m76", **SHAPE_76M), Path(tmp))
    print(_format_table(rows), flush=True)


def _cpu_has_bf16() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and "avx512_bf16" in cpuinfo.read_text()


def _make_model(out: Path, **shape) -> Path:
    from hybridflow.utils.tiny_model import make_tiny_model

    return make_tiny_model(out, **shape)


def _limits():
    """Per-request new-token limits, log-normal, at least 1, capped at MAX_NEW. (PROMPTS,)"""
    import torch

    normal = torch.randn(PROMPTS, generator=torch.Generator().manual_seed(0))
    lengths = torch.exp(torch.log(torch.tensor(MEDIAN_NEW)) + SIGMA * normal)
    return lengths.round().clamp(1, MAX_NEW).long()


def _prompts():
    import torch

    return torch.randint(10, 100, (PROMPTS, PROMPT_LEN), generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------- generation (subprocesses)


def _generation_rows(model_dir: Path, label: str, dtype: str) -> list[dict]:
    """Each engine in a fresh process per repetition (vLLM changes process-wide torch settings),
    the engines alternating, REPEATS rounds; medians, spreads and ratios of medians."""
    engines = ("hf", "vllm", "vllm-plain") if label == "76M" else ("hf", "vllm")
    sizes: dict[str, tuple[int, int]] = {}  # engine -> (useful tokens, parameters)

    def case(engine: str):
        def run() -> float:
            seconds, tokens, params = _run_worker("generate", engine, model_dir, dtype)
            sizes[engine] = (tokens, params)
            return seconds

        return run

    loads = LoadSamples()
    seconds = alternating({engine: case(engine) for engine in engines}, REPEATS, loads)
    peak = _matmul_peak(dtype)  # FLOP/s of the same threads and dtype
    print(f"generation {label} {dtype}: {GENERATION_THREADS} threads per engine process; {loads.text()}")
    base = summary(seconds["hf"])[0]
    return [_generation_row(e, label, dtype, seconds[e], sizes[e], base, peak, loads) for e in engines]


def _generation_row(engine, label, dtype, seconds, size, base, peak, loads) -> dict:
    median, spread = summary(seconds)
    tokens, params = size
    flops = 2 * params * tokens / median  # 2 FLOPs per parameter per token; attention not counted
    throughput = f"{tokens / median:.0f} tokens/s"
    return {
        "case": f"{engine} generate, {label}, {dtype}, {PROMPTS} prompts, heavy-tailed lengths",
        "size": f"{params / 1e6:.1f}M params, {tokens} tokens",
        "seconds (median)": median,
        "spread": f"{spread:.0%}",
        "throughput": throughput if engine == "hf" else f"{throughput} ({ratio_text(base, median, loads)})",
        "of matmul peak": f"{flops / peak:.1%} ({flops / 1e9:.1f} of {peak / 1e9:.0f} GFLOP/s)",
    }


def _run_worker(mode: str, engine: str, model_dir: Path, dtype: str) -> list:
    """This file's `mode` worker in a fresh process with GENERATION_THREADS threads; its JSON result."""
    env = {**os.environ, "OMP_NUM_THREADS": str(GENERATION_THREADS), "PYTHONPATH": str(REPO_ROOT)}
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, __file__, mode, engine, str(model_dir), dtype, out.name]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"{engine} {mode} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
        return json.loads(Path(out.name).read_text())


@functools.cache
def _matmul_peak(dtype: str) -> float:
    """`_matmul_worker`'s figure, probed once per dtype (the tiny and 76M fp32 rows share it)."""
    return _run_worker("matmul", "probe", Path(), dtype)[0]


def _matmul_worker(dtype: str, out: Path) -> None:
    """The machine's matmul throughput at `dtype` (FLOP/s): the median of 5 square products of
    2048 after a warm-up, on this process's threads."""
    import torch

    a, b = (torch.randn(2048, 2048, dtype=getattr(torch, dtype)) for _ in range(2))
    seconds = median_seconds(lambda: torch.mm(a, b), 5)
    out.write_text(json.dumps([2 * 2048**3 / seconds]))


def _generate_worker(engine_name: str, model_dir: Path, dtype: str, out: Path) -> None:
    import torch

    from engines.rollout.config import RolloutConfig
    from engines.weight_sync.model_shapes import expected_hf_tensor_shapes

    weights = "plain" if engine_name == "vllm-plain" else "packed"
    name = engine_name.removesuffix("-plain")
    cfg = RolloutConfig(
        name=name, load_format="auto", dtype=dtype, response_length=MAX_NEW, vllm_cpu_weights=weights
    )
    limits, prompts = _limits(), _prompts()
    if name == "vllm":
        from engines.rollout.vllm_rollout import VLLMRolloutEngine

        engine = VLLMRolloutEngine(model_dir, cfg)

        def generate(rows: int = PROMPTS, cap: int = MAX_NEW):
            vllm_generate_seconds(engine.llm, prompts[:rows], limits[:rows].clamp(max=cap))

    else:
        from engines.rollout.hf_rollout import HFRolloutEngine

        engine = HFRolloutEngine(model_dir, cfg, device="cpu")

        def generate(rows: int = PROMPTS, cap: int = MAX_NEW):
            longest = min(int(limits.max()), cap)
            with torch.no_grad():
                engine.model.generate(
                    input_ids=prompts[:rows], do_sample=True, max_new_tokens=longest, min_new_tokens=longest
                )

    generate(rows=4, cap=8)
    start = time.perf_counter()
    generate()
    seconds = time.perf_counter() - start
    shapes, _ = expected_hf_tensor_shapes(model_dir)
    size = sum(math.prod(shape) for shape in shapes.values())
    out.write_text(json.dumps([seconds, int(limits.sum()), size]))


def vllm_generate_seconds(llm, prompts, limits, lora_request=None) -> float:
    """Seconds for vLLM's `llm` to generate `prompts` (P, T) with per-request new-token `limits`
    (P,), EOS ignored, request i seeded i."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    requests = [TokensPrompt(prompt_token_ids=row.tolist()) for row in prompts]
    params = [SamplingParams(max_tokens=int(n), ignore_eos=True, seed=i) for i, n in enumerate(limits)]
    start = time.perf_counter()
    llm.generate(requests, params, use_tqdm=False, lora_request=lora_request)
    return time.perf_counter() - start


# ---------------------------------------------------------------- weight sync (torchrun)


def _sync_worker(model_dir: Path, result_file: Path, weights: str) -> None:
    """Runs on each torchrun rank; rank 0 writes the rows."""
    import torch
    import torch.distributed as dist

    from engines.megatron.build import build_model
    from engines.megatron.config import MegatronConfig
    from engines.megatron.model import unwrap_model
    from engines.megatron.parallel import init_megatron
    from engines.megatron.weights import iter_hf_tensors
    from engines.rollout.config import RolloutConfig
    from engines.rollout.sharding_manager import MegatronRolloutShardingManager
    from engines.rollout.vllm_rollout import VLLMRolloutEngine

    tp = int(os.environ["WORLD_SIZE"])
    megatron_cfg = MegatronConfig(tensor_model_parallel_size=tp)
    init_megatron(megatron_cfg)
    chunks = build_model(model_dir, megatron_cfg, for_training=False)
    hf_config = unwrap_model(chunks[0]).hf_config
    cfg = RolloutConfig(name="vllm", free_cache_engine=False, vllm_cpu_weights=weights)
    engine = VLLMRolloutEngine(model_dir, cfg)
    manager = MegatronRolloutShardingManager(chunks, hf_config, engine, cfg)
    sources = [tensor.clone() for _, tensor in iter_hf_tensors(chunks, hf_config)]
    targets = [torch.empty_like(tensor) for tensor in sources]

    @torch.no_grad()
    def plain_copy():
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source)

    # Warm-up, then sync and copy alternating, so that a change of the machine's load hits both.
    manager.load_weights()
    plain_copy()
    loads = LoadSamples()
    timers = {"sync": _timer_from_barrier(manager.load_weights), "copy": _timer_from_barrier(plain_copy)}
    seconds = alternating(timers, SYNC_REPEATS, loads)
    nbytes = manager.last_sync.bytes
    sync_case = f"weight sync actor TP{tp} -> vllm, {weights} weights"
    rows = [
        _sync_row(sync_case, nbytes, seconds["sync"], seconds["copy"], loads),
        _sync_row(
            f"plain copy, same bytes (TP{tp}, {weights} run)", nbytes, seconds["copy"], seconds["copy"], loads
        ),
    ]
    if dist.get_rank() == 0:
        result_file.write_text(json.dumps(rows))
    if os.environ.get("BENCH_SYNC_PROFILE"):
        _profile_one_sync(manager, Path(f"{os.environ['BENCH_SYNC_PROFILE']}.tp{tp}.{weights}.txt"))
    dist.barrier()
    engine.shutdown()  # also ends the process group (vLLM's teardown)


def _profile_one_sync(manager, out: Path) -> None:
    """cProfile of one more sync (collective: every rank syncs); rank 0 writes its costliest calls,
    by own time and by cumulative time (docs/engines.md, "Weight sync at TP2")."""
    import cProfile
    import io
    import pstats

    import torch.distributed as dist

    profiler = cProfile.Profile()
    profiler.runcall(manager.load_weights)
    if dist.get_rank() == 0:
        text = io.StringIO()
        for order in ("tottime", "cumulative"):
            pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(25)
        out.write_text(text.getvalue())


def _timer_from_barrier(fn):
    """Seconds of `fn`, started on every rank at once: at TP2 the two ranks' copies then always
    overlap, as their syncs do (unaligned, a rank's copy sometimes ran alone: 0.026-0.041 s)."""
    import torch.distributed as dist

    def run() -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return run


def _sync_row(case: str, nbytes: int, seconds: list[float], copy_seconds: list[float], loads) -> dict:
    median, spread = summary(seconds)
    share = _share_text(summary(copy_seconds)[0] / median, loads)
    return {
        "case": case,
        "size": f"{nbytes / 1e6:.0f} MB",
        "seconds (median)": median,
        "spread": f"{spread:.0%}",
        "throughput": f"{nbytes / median / 1e9:.2f} GB/s ({share}; {loads.text()})",
        "of matmul peak": "",
    }


def _share_text(share: float, loads: LoadSamples) -> str:
    """`share` of a plain copy's rate, or why none is given (as `ratio_text` refuses a ratio)."""
    if loads.moved() > LOAD_LIMIT:
        return f"no share: the load moved by {loads.moved():.2f} during the run (limit {LOAD_LIMIT:g})"
    return f"{share:.0%} of plain copy"


if __name__ == "__main__":
    if sys.argv[1] == "generate":
        _generate_worker(sys.argv[2], Path(sys.argv[3]), sys.argv[4], Path(sys.argv[5]))
    elif sys.argv[1] == "matmul":
        _matmul_worker(sys.argv[4], Path(sys.argv[5]))
    elif sys.argv[1] == "sync":
        _sync_only()
    else:
        _sync_worker(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
