"""Hub ids resolve through `snapshot_download` from a pre-filled local Hub cache with
HF_HUB_OFFLINE=1 (no network): model paths in a recipe, with revisions, and the GSM8K dataset of
scripts/prepare_gsm8k.py. Each case runs in a subprocess because huggingface_hub reads HF_HOME
and HF_HUB_OFFLINE when it is imported."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hub_cache import fill_hub_cache

from hybridflow.data.arith import write_arith_parquet
from hybridflow.utils.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
PREPARE = """
import json, sys
from hybridflow.trainer.main import prepare
cfg, _ = prepare(sys.argv[1:])
print(json.dumps({"path": cfg.model.path, "tokenizer": cfg.model.tokenizer_path}))
"""


def offline_env(hf_home: Path) -> dict:
    return {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hub")
    tiny = make_tiny_model(root / "tiny")
    files = {p.name: p for p in tiny.iterdir() if p.is_file()}
    hf_home = root / "hf_home"
    main = fill_hub_cache(hf_home, "hybridflow-tests/tiny-qwen2", files)
    tagged = fill_hub_cache(hf_home, "hybridflow-tests/tiny-qwen2", files, revision="v1")
    data = write_arith_parquet(root / "data")["train"]  # the pre-flight check reads every prompt row
    return {"root": root, "hf_home": hf_home, "main": main, "tagged": tagged, "data": data}


def recipe_args(hub: dict, *overrides: str) -> list[str]:
    return [
        str(ROOT / "recipes" / "quickstart.yaml"),
        f"data.train_files=[{hub['data']}]",
        f"data.val_files=[{hub['data']}]",
        f"trainer.output_dir={hub['root'] / 'out'}",
        *overrides,
    ]


def test_a_recipe_hub_id_resolves_to_the_cached_snapshot(hub):
    args = recipe_args(
        hub, "model.path=hybridflow-tests/tiny-qwen2", "model.tokenizer_path=hybridflow-tests/tiny-qwen2"
    )
    out = subprocess.run(
        [sys.executable, "-c", PREPARE, *args],
        capture_output=True,
        text=True,
        env=offline_env(hub["hf_home"]),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    resolved = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(resolved["path"]) == hub["main"] and Path(resolved["tokenizer"]) == hub["main"]
    # the workers get the local directory: it is what the resolved recipe records
    assert f"path: {hub['main']}" in (hub["root"] / "out" / "config.yaml").read_text()


def test_model_revision_picks_the_tagged_snapshot(hub):
    args = recipe_args(hub, "model.path=hybridflow-tests/tiny-qwen2", "model.revision=v1")
    out = subprocess.run(
        [sys.executable, "-c", PREPARE, *args],
        capture_output=True,
        text=True,
        env=offline_env(hub["hf_home"]),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert Path(json.loads(out.stdout.strip().splitlines()[-1])["path"]) == hub["tagged"] != hub["main"]


def test_an_uncached_hub_id_offline_says_how_to_fetch_it(hub):
    args = recipe_args(hub, "model.path=hybridflow-tests/absent")
    out = subprocess.run(
        [sys.executable, "-m", "hybridflow.trainer.main", *args],
        capture_output=True,
        text=True,
        env=offline_env(hub["hf_home"]),
    )
    assert out.returncode == 2
    assert "model.path=hybridflow-tests/absent is neither a local directory nor a usable Hub id" in out.stderr
    assert "LocalEntryNotFoundError" in out.stderr and "hf download <id> --local-dir <dir>" in out.stderr


GSM8K = {
    "train": [
        {"question": "Tom has 3 apples and buys 2 more. How many apples?", "answer": "3 + 2 = 5\n#### 5"},
        {"question": "A book costs $1,200. What is twice that?", "answer": "2 * 1200 = 2400\n#### 2,400"},
    ],
    "test": [{"question": "What is 7 times 6?", "answer": "7 * 6 = 42\n#### 42"}],
}


def test_prepare_gsm8k_from_the_hub_cache_matches_the_local_jsonl(tmp_path):
    """The Hub dataset (openai/gsm8k's main/<split>-*.parquet) and the original jsonl give the same rows."""
    jsonl_dir, hf_home = tmp_path / "jsonl", tmp_path / "hf_home"
    jsonl_dir.mkdir()
    files = {}
    for split, records in GSM8K.items():
        (jsonl_dir / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        pq.write_table(pa.Table.from_pylist(records), tmp_path / f"{split}.parquet")
        files[f"main/{split}-00000-of-00001.parquet"] = tmp_path / f"{split}.parquet"
    fill_hub_cache(hf_home, "openai/gsm8k", files, repo_type="dataset")
    script = ROOT / "scripts" / "prepare_gsm8k.py"
    env = offline_env(hf_home)
    subprocess.run([sys.executable, script, "--out", tmp_path / "hub_rows"], check=True, env=env)
    subprocess.run(
        [sys.executable, script, "--local_dir", jsonl_dir, "--out", tmp_path / "local_rows"],
        check=True,
        env=env,
    )
    for split in GSM8K:
        from_hub = pq.read_table(tmp_path / "hub_rows" / f"{split}.parquet").to_pylist()
        assert from_hub == pq.read_table(tmp_path / "local_rows" / f"{split}.parquet").to_pylist()
        assert [r["reward_model"]["ground_truth"] for r in from_hub] == [
            r["answer"].rsplit("#### ", 1)[1].replace(",", "") for r in GSM8K[split]
        ]
    missing = subprocess.run(
        [sys.executable, script, "--revision", "v9", "--out", tmp_path / "none"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert (
        missing.returncode != 0
        and "could not resolve the Hub dataset openai/gsm8k at revision v9" in missing.stderr
    )
