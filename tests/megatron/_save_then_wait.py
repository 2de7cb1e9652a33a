"""Helper process for test_checkpoint_helpers.py (one process, gloo): builds a tiny Megatron
actor with its optimizer, saves two dist checkpoints with `save_checkpoint` (OUT_DIR/ckpt, ckpt2),
prints SAVED and then waits to be killed.

    python _save_then_wait.py OUT_DIR
"""

import sys
import time
from pathlib import Path

from tiny_hf import make_tiny_hf_checkpoint

from engines.megatron.build import build_model
from engines.megatron.checkpoint import save_checkpoint
from engines.megatron.config import MegatronConfig, OptimConfig
from engines.megatron.optimizer import build_optimizer
from engines.megatron.parallel import init_megatron


def main(out: Path) -> None:
    hf_dir = make_tiny_hf_checkpoint(out / "hf")
    cfg = MegatronConfig()
    init_megatron(cfg)
    chunks = build_model(hf_dir, cfg)
    optimizer, scheduler = build_optimizer(chunks, OptimConfig(), cfg)
    save_checkpoint(chunks, optimizer, scheduler, out / "ckpt")
    save_checkpoint(chunks, optimizer, scheduler, out / "ckpt2")  # the results queue used again
    print("SAVED", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
