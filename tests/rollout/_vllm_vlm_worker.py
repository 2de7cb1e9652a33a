"""Worker for test_vllm_vlm_rollout.py, in a process of its own: vLLM's Transformers backend
decorates transformers' decoder class in place for its compiler
(vllm/model_executor/models/transformers/base.py, `_decorate_for_torch_compile`), after which
that class is built only inside a vLLM engine, and the test process goes on to other tests.

    python tests/rollout/_vllm_vlm_worker.py HF_DIR OUT_JSON

Starts the `vllm` engine (`model_impl: transformers`) from random weights, loads the checkpoint's
tensors through the weight-update session (tower and projector included), and writes the greedy
responses to image_rows.ROWS and the first response token's log-probs of two rows and of the same
rows with their images swapped.
"""

import json
import sys
from pathlib import Path

from image_rows import MIXED, RED_CIRCLE, engine_responses, greedy_rollout_config, left_padded, row_inputs
from safetensors.torch import load_file
from transformers import AutoProcessor

from engines.rollout.vllm_rollout import VLLMRolloutEngine

SWAP_ROWS = [("<image>What is this?", [RED_CIRCLE]), ("<image>What is this?", [MIXED])]


def synced_engine(model_dir: Path) -> VLLMRolloutEngine:
    engine = VLLMRolloutEngine(model_dir, greedy_rollout_config("vllm", load_format="dummy"))
    engine.begin_weight_update()
    engine.update_weights(load_file(model_dir / "model.safetensors").items())
    engine.end_weight_update()
    return engine


def first_log_probs(engine, processor, rows) -> list[float]:
    out = engine.generate_sequences(left_padded(row_inputs(processor, rows), engine.pad_token_id))
    return out.batch["rollout_log_probs"][:, 0].tolist()


def main(model_dir: Path, out: Path) -> None:
    processor = AutoProcessor.from_pretrained(model_dir)
    engine = synced_engine(model_dir)
    prompts = left_padded(row_inputs(processor), engine.pad_token_id)
    swapped = [(text, images) for (text, _), (_, images) in zip(SWAP_ROWS, SWAP_ROWS[::-1], strict=True)]
    result = {
        "responses": engine_responses(engine.generate_sequences(prompts)),
        "first_log_probs": first_log_probs(engine, processor, SWAP_ROWS),
        "first_log_probs_swapped": first_log_probs(engine, processor, swapped),
    }
    engine.shutdown()
    out.write_text(json.dumps(result))
    print("OK vllm-vlm")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
