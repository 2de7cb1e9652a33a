"""Worker for test_vllm_rollout.py: real vLLM (CPU build) engines fed by a Megatron actor, under
torchrun on gloo. N = 4: actor TP2 x PP2; N = 1: actor TP1; N = 2: actor TP2 and one vLLM engine
at TP 2 over both ranks. Every rank holds one vLLM engine (N = 2: its TP shard) and one hf
engine, both started with random weights (`load_format: dummy`), so every weight they generate
with came through the sync.

    python -m torch.distributed.run --nproc_per_node N tests/rollout/_vllm_worker.py HF_DIR OUT_DIR [WEIGHTS]

WEIGHTS is `rollout.vllm_cpu_weights` (packed, vLLM's default, or plain: engines/rollout/
vllm_cpu_weights.py); every check below runs the same in both.

Checks, printing "OK <check>" on rank 0 after each:
  greedy-equals-hf  after a sync of the perturbed actor, vLLM's greedy responses (and masks) equal
                    the hf engine's on 32 prompts, except rows whose first difference is a near
                    tie in hf's log-probs (top-2 within 1e-4); N = 1, 2 add stop strings to greedy
                    decoding and a second EOS id the model emits, and requires rows ended by EOS,
                    by a stop string and by the length;
  log-probs-match   sampled responses' rollout_log_probs (temperature 0.8) equal the actor's
                    compute_log_prob of the same tokens within 1e-4 (fp32);
  seeds             the same seed gives the same samples, another seed other samples;
  top-k             (N = 1) the same engine with rollout.top_k_log_probs=3: unchanged samples and
                    log-probs, (B, R, 3) top-K ids and log-probs, likeliest first, consistent with
                    the sampled token's, equal to hf's forward of the same tokens within 1e-4;
  requests-equal-batch  (N = 1) requests awaited one by one through the request-level engine
                    (engines/rollout/requests.py), joining at different decoding steps, sample
                    what one batch call samples with the same seeds, with their log-probs and
                    the policy version of every token;
  (every vLLM sync runs with verify_weight_sync: the engine's log-probs of fixed tokens equal the
  actor's)
  wrong-name        (N = 4) a sync stream with a misnamed tensor on rank 1 fails on every rank
                    with a WeightSyncError naming it; wrong-shape: the same for a wrong shape;
  verify-catches    (N = 4) a tensor changed in transit on rank 1 fails verify_weight_sync on
                    every rank;
  actor-untouched   the syncs into both engines, whose stream hands them views of the actor's
                    parameters at TP 1, leave the actor's parameters bit for bit as they were;
  plain-in-place    (plain) the engine's linear weights are plain parameters equal to the actor's
                    tensors after the sync, bit for bit.
"""

import os
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from actor_noise import perturb

from engines.megatron import hf_stream
from engines.megatron import weights as megatron_weights
from engines.megatron.actor import MegatronActor
from engines.megatron.build import build_model
from engines.megatron.config import MegatronConfig
from engines.megatron.model import unwrap_model
from engines.megatron.parallel import init_megatron
from engines.megatron.weights import save_hf_checkpoint
from engines.rollout.config import RolloutConfig, SamplingConfig
from engines.rollout.hf_rollout import HFRolloutEngine
from engines.rollout.sharding_manager import MegatronRolloutShardingManager
from engines.rollout.vllm_rollout import VLLMRolloutEngine
from engines.weight_sync.common import WeightSyncError
from hybridflow.protocol import DataProto

PROMPTS = 32
RESPONSE_LENGTH = 16
LONG_PROMPT = 400  # tokens; the tiny model's context is 512
TIE = 1e-4
LOG_PROB_TOLERANCE = 1e-4
TEMPERATURE = 0.8
STOP = ["q", "Z"]  # one-character tokens of the shared tokenizer


def with_frequent_eos(chunks, hf_config, hf_dir: Path, out_dir: Path) -> Path:
    """A copy of `hf_dir` whose EOS ids add a token the synced model emits early in greedy
    decoding of prompt row 0 (a random model rarely emits the real EOS): some rows end on EOS."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    export = out_dir / "export"
    save_hf_checkpoint(chunks, hf_config, export)
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    prompts = make_prompts(validate=True)
    row = prompts.batch["input_ids"][0][prompts.batch["attention_mask"][0].bool()]
    with torch.no_grad():
        free_run = model.generate(input_ids=row[None], do_sample=False, max_new_tokens=4, eos_token_id=None)
    eos = int(free_run[0, -1])
    target = out_dir / f"frequent_eos_{dist.get_rank()}"
    shutil.copytree(hf_dir, target)
    generation = json.loads((target / "generation_config.json").read_text())
    generation["eos_token_id"] = [1, eos]
    (target / "generation_config.json").write_text(json.dumps(generation))
    return target


def make_prompts(validate: bool) -> DataProto:
    gen = torch.Generator().manual_seed(1)
    width = 12
    lengths = [2 + (5 * row) % (width - 1) for row in range(PROMPTS)]
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
    ids = torch.randint(7, 100, mask.shape, generator=gen) * mask
    uids = np.array([f"uid-{row}" for row in range(PROMPTS)], dtype=object)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": positions},
        {"uid": uids},
        {"validate": validate},
    )


def generate(manager, engine, prompts: DataProto) -> DataProto:
    manager.load_weights()
    with manager.generating():
        return manager.postprocess_data(engine.generate_sequences(manager.preprocess_data(prompts)))


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    differ = (a != b).nonzero()
    return None if len(differ) == 0 else int(differ[0])


@torch.no_grad()
def top2_gap(model, prompt: torch.Tensor, prefix: torch.Tensor) -> float:
    """hf's log-prob gap between its two likeliest next tokens after prompt + prefix."""
    ids = torch.cat([prompt, prefix])[None]
    log_probs = model(input_ids=ids).logits[0, -1].float().log_softmax(-1)
    top = log_probs.topk(2).values
    return float(top[0] - top[1])


def check_greedy_equals_hf(hf_engine, vllm_out: DataProto, hf_out: DataProto, model_dir: Path | None) -> None:
    equal = ties = 0
    for row in range(PROMPTS):
        ours, theirs = vllm_out.batch["responses"][row], hf_out.batch["responses"][row]
        where = first_difference(ours, theirs)
        if where is None:
            assert torch.equal(vllm_out.batch["response_mask"][row], hf_out.batch["response_mask"][row]), row
            equal += 1
            continue
        prompt = hf_out.batch["prompts"][row][hf_out.batch["attention_mask"][row, :-RESPONSE_LENGTH].bool()]
        gap = top2_gap(hf_engine.model, prompt, theirs[:where])
        assert gap < TIE, f"row {row} differs at token {where} where hf's top-2 gap is {gap:.2e}"
        ties += 1
    assert equal + ties == PROMPTS and equal >= PROMPTS - 2, (equal, ties)
    if model_dir is not None:
        check_endings(vllm_out, model_dir, hf_engine.eos_token_ids)
    say(f"greedy-equals-hf ({equal} equal, {ties} near ties)")


def check_endings(out: DataProto, model_dir: Path, eos_ids: list[int]) -> None:
    """Some rows end on EOS, some on a stop string, some at the length limit."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    endings = set()
    for row, length in enumerate(out.batch["response_mask"].sum(-1).tolist()):
        ids = out.batch["responses"][row, :length].tolist()
        if ids[-1] in eos_ids:
            endings.add("eos")
        elif any(tokenizer.decode(ids).endswith(stop) for stop in STOP):
            endings.add("stop")
        elif length == RESPONSE_LENGTH:
            endings.add("length")
    assert endings == {"eos", "stop", "length"}, endings


def check_log_probs(actor: MegatronActor, out: DataProto) -> None:
    from megatron.core import parallel_state

    data = DataProto.from_dict(
        {key: out.batch[key] for key in ("input_ids", "attention_mask", "position_ids", "responses")},
        meta_info={"temperature": TEMPERATURE, "micro_batch_size": 8},
    )
    result = actor.compute_log_prob(data, calculate_entropy=False)
    if parallel_state.is_pipeline_last_stage():
        mask = out.batch["response_mask"].bool()
        actor_lp = result.batch["old_log_probs"][mask]
        rollout_lp = out.batch["rollout_log_probs"][mask]
        worst = float((actor_lp - rollout_lp).abs().max())
        assert worst < LOG_PROB_TOLERANCE, f"max |actor - rollout| log-prob = {worst:.2e}"
        assert mask.sum() > PROMPTS, "too few sampled tokens to compare"
    say("log-probs-match")


def check_seeds(manager, engine, prompts: DataProto) -> None:
    def sample(seed: int) -> torch.Tensor:
        batch = prompts[:]
        batch.meta_info["seed"] = seed
        return generate(manager, engine, batch).batch["responses"]

    first, again, other = sample(7), sample(7), sample(8)
    assert torch.equal(first, again), "the same seed gave other samples"
    assert not torch.equal(first, other), "another seed gave the same samples"
    say("seeds")


def check_requests_equal_batch(engine: VLLMRolloutEngine, cfg: RolloutConfig, prompts: DataProto) -> None:
    """Requests awaited one by one (arriving at different decoding steps, batched by the engine
    while in flight) sample what one batch call samples with the same seeds, and record the
    policy version of every token."""
    import asyncio

    from engines.rollout.base import row_seed
    from engines.rollout.requests import VLLMRequestEngine

    requests = VLLMRequestEngine(engine, cfg)
    requests.policy_version = 3
    ids, masks = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    rows = [row[mask.bool()].tolist() for row, mask in zip(ids, masks, strict=True)]

    async def staggered():
        async def one(row: int):
            for _ in range(row):  # later rows join while earlier ones are decoding
                await asyncio.sleep(0)
            return await requests.generate(rows[row], cfg.sampling, row_seed(11, row), RESPONSE_LENGTH)

        return await asyncio.gather(*(one(row) for row in range(len(rows))))

    completions = asyncio.run(staggered())
    batch = prompts[:]
    batch.meta_info["seed"] = 11
    expected = engine.generate_sequences(batch)
    for row, completion in enumerate(completions):
        n = len(completion.token_ids)
        assert n == int(expected.batch["response_mask"][row].sum()), row
        assert completion.token_ids == expected.batch["responses"][row, :n].tolist(), row
        assert completion.versions == [3] * n and completion.finish_reason in ("stop", "length")
        expected_lp = expected.batch["rollout_log_probs"][row, :n]
        assert torch.allclose(torch.tensor(completion.log_probs), expected_lp, atol=1e-5), row
    say("requests-equal-batch")


def check_top_k(engine: VLLMRolloutEngine, hf_engine: HFRolloutEngine, prompts: DataProto) -> None:
    """The same engine asked for K = 3: the samples and their log-probs are those of K = 0; (B, R, K)
    ids and log-probs, likeliest first, 0 on padding; a sampled token among them has its own
    log-prob there, one outside them is below all K; and they are hf's forward of the same tokens."""
    k, plain = 3, engine.cfg
    prompts.meta_info["seed"] = 13
    engine.cfg = replace(plain, top_k_log_probs=k)
    try:
        out = engine.generate_sequences(prompts)
    finally:
        engine.cfg = plain
    expected = engine.generate_sequences(prompts)
    for key in ("responses", "rollout_log_probs"):
        assert torch.equal(out.batch[key], expected.batch[key]), key
    ids, log_probs = out.batch["rollout_top_k_ids"], out.batch["rollout_top_k_log_probs"]  # (B, R, K)
    assert ids.shape == log_probs.shape == (PROMPTS, RESPONSE_LENGTH, k)
    assert (ids.dtype, log_probs.dtype) == (torch.int64, torch.float32)
    mask = out.batch["response_mask"].bool()  # (B, R)
    assert (ids[~mask] == 0).all() and (log_probs[~mask] == 0).all()
    top_ids, top = ids[mask], log_probs[mask]  # (N, K)
    assert (top[:, :-1] >= top[:, 1:]).all()
    sampled, sampled_lp = out.batch["responses"][mask], out.batch["rollout_log_probs"][mask]  # (N,)
    hit = top_ids == sampled[:, None]  # (N, K)
    among = hit.any(-1)  # (N,)
    assert torch.equal(top[hit], sampled_lp[among]) and (top[~among] >= sampled_lp[~among, None]).all()
    assert among.any() and (~among).any(), "both cases should occur at temperature 0.8"
    with torch.no_grad():
        logits = hf_engine.model(
            input_ids=out.batch["input_ids"],
            attention_mask=out.batch["attention_mask"],
            position_ids=out.batch["position_ids"],
        ).logits  # (B, P+R, V)
    reference = (logits[:, -RESPONSE_LENGTH - 1 : -1].float() / TEMPERATURE).log_softmax(-1)  # (B, R, V)
    # values against hf's own top K, and hf's log-probs of vLLM's ids (near ties may swap ids)
    worst = max(
        float((reference.topk(k).values[mask] - top).abs().max()),
        float((reference.gather(-1, ids)[mask] - top).abs().max()),
    )
    assert worst < LOG_PROB_TOLERANCE, f"max |hf - vllm| top-{k} log-prob = {worst:.2e}"
    say("top-k")


def check_prompts_beyond_one_step(engine: VLLMRolloutEngine) -> None:
    """More prompt tokens than one engine step schedules, every request seeded: the prefills span
    several steps and sampling still works (with chunked prefill vLLM 0.32 fails here on CPU)."""
    budget = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    rows, width = budget // LONG_PROMPT + 2, LONG_PROMPT
    ids = torch.randint(7, 100, (rows, width), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    positions = torch.arange(width).expand(rows, width)
    prompts = DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": positions})
    prompts.meta_info.update({"validate": False, "seed": 5})
    out = engine.generate_sequences(prompts)
    assert bool((out.batch["response_mask"].sum(-1) > 0).all()), "a request sampled nothing"
    say("beyond-one-step")


def check_bad_stream(manager, edit, expected: str) -> None:
    """A sync whose stream `edit` changes on rank 1 must fail on every rank, naming the tensor.
    The stream is replaced where the colocated sync looks it up (engines/megatron/hf_stream.py)."""
    real = hf_stream.iter_hf_tensors

    def stream(*args, **kwargs):
        for index, (name, tensor) in enumerate(real(*args, **kwargs)):
            yield edit(name, tensor) if index == 3 and dist.get_rank() == 1 else (name, tensor)

    hf_stream.iter_hf_tensors = stream
    try:
        manager.load_weights()
        raise AssertionError("the bad sync was not caught")
    except WeightSyncError as err:
        assert "rank 1" in str(err) and expected in str(err), str(err)
    finally:
        hf_stream.iter_hf_tensors = real


def say(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"OK {message}", flush=True)


def check_plain_in_place(engine: VLLMRolloutEngine, chunks, hf_config) -> None:
    name = "model.layers.0.mlp.down_proj.weight"  # a linear layer, the same name in vLLM's model
    held = engine.llm.collective_rpc(_read_parameter, args=(name,))[0]
    sent = dict(megatron_weights.iter_hf_tensors(chunks, hf_config))[name]
    assert torch.equal(held, sent), f"{name}: the engine holds other values than the actor sent"


def _read_parameter(worker, name: str) -> torch.Tensor:
    return dict(worker.model_runner.get_model().named_parameters())[name].detach().clone()


def main(hf_dir: Path, out_dir: Path, weights: str) -> None:
    world = int(os.environ["WORLD_SIZE"])
    four = world == 4
    megatron_cfg = MegatronConfig(
        tensor_model_parallel_size=1 if world == 1 else 2, pipeline_model_parallel_size=2 if world == 4 else 1
    )
    init_megatron(megatron_cfg)
    chunks = build_model(hf_dir, megatron_cfg, for_training=False)
    hf_config = unwrap_model(chunks[0]).hf_config
    perturb(chunks)
    if not four:
        hf_dir = with_frequent_eos(chunks, hf_config, hf_dir, out_dir)
    greedy = SamplingConfig(do_sample=False, temperature=0.0, stop=[] if four else STOP)
    cfg = RolloutConfig(
        response_length=RESPONSE_LENGTH,
        sampling=SamplingConfig(temperature=TEMPERATURE),
        val_sampling=greedy,
        calculate_log_probs=True,
        weight_sync_bucket_mb=0.05,  # buckets end inside layers
    )
    hf_engine = HFRolloutEngine(hf_dir, cfg, device="cpu")
    # every sync below is verified; N = 2: one vLLM engine at TP 2 over both ranks
    vllm_cfg = replace(
        cfg,
        name="vllm",
        verify_weight_sync=True,
        tensor_model_parallel_size=2 if world == 2 else 1,
        vllm_cpu_weights=weights,
    )
    vllm_engine = VLLMRolloutEngine(hf_dir, vllm_cfg)
    hf_manager = MegatronRolloutShardingManager(chunks, hf_config, hf_engine, cfg)
    vllm_manager = MegatronRolloutShardingManager(chunks, hf_config, vllm_engine, vllm_cfg)

    before = [param.detach().clone() for chunk in chunks for param in chunk.parameters()]
    vllm_greedy = generate(vllm_manager, vllm_engine, make_prompts(validate=True))
    hf_greedy = generate(hf_manager, hf_engine, make_prompts(validate=True))
    after = [param.detach() for chunk in chunks for param in chunk.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "a sync wrote to the actor"
    say("actor-untouched")
    check_greedy_equals_hf(hf_engine, vllm_greedy, hf_greedy, model_dir=None if four else hf_dir)
    if weights == "plain" and world == 1:
        check_plain_in_place(vllm_engine, chunks, hf_config)
        say("plain-in-place")
    sampled = generate(vllm_manager, vllm_engine, make_prompts(validate=False))
    check_log_probs(MegatronActor(chunks), sampled)
    check_seeds(vllm_manager, vllm_engine, make_prompts(validate=False))
    if world == 1:
        check_requests_equal_batch(vllm_engine, vllm_cfg, make_prompts(validate=False))
        check_top_k(vllm_engine, hf_engine, make_prompts(validate=False))
        check_prompts_beyond_one_step(vllm_engine)
    if four:
        check_bad_stream(vllm_manager, lambda name, t: (name.replace("layers", "layer"), t), "layer.")
        say("wrong-name")
        check_bad_stream(vllm_manager, lambda name, t: (name, t[..., :-1]), "has shape")
        say("wrong-shape")
        check_bad_stream(vllm_manager, lambda name, t: (name, t + 0.5), "log-probs of fixed tokens differ")
        say("verify-catches")
    dist.barrier()
    vllm_engine.shutdown()  # vLLM's teardown destroys the process group too


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "packed")
