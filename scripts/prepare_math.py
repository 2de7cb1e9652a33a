"""Writes MATH-style problems as hybridflow prompt rows: <out>/train.parquet and <out>/test.parquet.

    python scripts/prepare_math.py --local_dir <dir> --out data/math
    python scripts/prepare_math.py --out data/math     # the Hub dataset DigitalLearningGmbH/MATH-lighteval

A record has `problem` and either `answer` or a `solution` whose last \\boxed{...} is the answer (the
MATH format; records with neither are skipped and counted). `--local_dir` holds train/test as
.jsonl or .parquet; without it the Hub dataset's parquet files are fetched through huggingface_hub
into the Hugging Face cache (HF_HUB_OFFLINE=1: an already cached snapshot). Rows are scored by
hybridflow.reward.math_reward (data_source "math"): symbolic comparison through math-verify.
"""

import argparse
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from hybridflow.reward.math_reward import last_boxed
from hybridflow.utils.hub import download_snapshot

SPLITS = ("train", "test")
HUB_DATASET = "DigitalLearningGmbH/MATH-lighteval"
DATA_SOURCE = "math"
INSTRUCTION = "Reason step by step, and put your final answer within \\boxed{}."


def answer_of(record: dict) -> str | None:
    """The record's final answer: its `answer` field, else the last boxed answer of its solution."""
    if record.get("answer"):
        return str(record["answer"]).strip()
    return last_boxed(record.get("solution") or "")


def to_row(record: dict, answer: str, split: str, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{record['problem']} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {
            "split": split,
            "index": index,
            "level": str(record.get("level") or ""),
            "type": str(record.get("type") or ""),
        },
    }


def read_file(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def local_files(local_dir: Path, split: str) -> list[Path]:
    files = [local_dir / f"{split}{suffix}" for suffix in (".jsonl", ".parquet")]
    found = [f for f in files if f.is_file()]
    if not found:
        raise FileNotFoundError(f"--local_dir {local_dir} has neither {files[0].name} nor {files[1].name}")
    return found


def hub_files(hub_dataset: str, revision: str | None) -> dict[str, list[Path]]:
    snapshot = download_snapshot(
        hub_dataset, repo_type="dataset", revision=revision, allow_patterns=["*.parquet"]
    )
    files = {
        split: sorted(p for p in snapshot.rglob("*.parquet") if p.name.startswith(split)) for split in SPLITS
    }
    missing = [split for split, found in files.items() if not found]
    if missing:
        raise FileNotFoundError(f"{hub_dataset} snapshot {snapshot} has no parquet file named {missing}*")
    return files


def build_rows(records: list[dict], split: str) -> tuple[list[dict], int]:
    """Rows of the records that have a final answer, and how many had none."""
    rows, skipped = [], 0
    for record in records:
        if "problem" not in record:
            raise ValueError(f"{split}: a record has no 'problem' field (keys {sorted(record)})")
        answer = answer_of(record)
        if answer is None:
            skipped += 1
            continue
        rows.append(to_row(record, answer, split, len(rows)))
    return rows, skipped


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--local_dir", type=Path, help="directory with train/test .jsonl or .parquet")
    parser.add_argument("--out", type=Path, required=True, help="output directory for train/test parquet")
    parser.add_argument(
        "--hub_dataset", default=HUB_DATASET, help=f"Hub dataset without --local_dir ({HUB_DATASET})"
    )
    parser.add_argument("--revision", help="branch, tag or commit of the Hub dataset (default: main)")
    args = parser.parse_args()
    try:
        if args.local_dir is not None:
            files = {split: local_files(args.local_dir, split) for split in SPLITS}
        else:
            files = hub_files(args.hub_dataset, args.revision)
        # every split is read and checked before anything is written
        built = {
            split: build_rows([r for f in files[split] for r in read_file(f)], split) for split in SPLITS
        }
    except (ValueError, FileNotFoundError) as err:
        raise SystemExit(f"error: {err}") from None
    args.out.mkdir(parents=True, exist_ok=True)
    for split, (rows, skipped) in built.items():
        pq.write_table(pa.Table.from_pylist(rows), args.out / f"{split}.parquet")
        print(
            f"wrote {len(rows)} rows to {args.out / f'{split}.parquet'} ({skipped} without an answer skipped)"
        )


if __name__ == "__main__":
    main()
