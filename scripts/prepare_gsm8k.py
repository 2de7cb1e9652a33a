"""Writes GSM8K as hybridflow prompt rows: <out>/train.parquet and <out>/test.parquet.

    python scripts/prepare_gsm8k.py --local_dir ../shared/data/gsm8k --out data/gsm8k   # the shared copy
    python scripts/prepare_gsm8k.py --out data/gsm8k        # the openai/gsm8k dataset from the Hub

`--local_dir` holds GSM8K's original train.jsonl and test.jsonl. Without it the `main` config of the
Hub dataset `openai/gsm8k` (its parquet files) is fetched through `huggingface_hub` into the
Hugging Face cache; HF_HUB_OFFLINE=1 reads an already cached snapshot. Both give the same rows.
"""

import argparse
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from hybridflow.data.gsm8k import read_jsonl, to_row
from hybridflow.utils.hub import download_snapshot

SPLITS = ("train", "test")
HUB_DATASET = "openai/gsm8k"


def load_records(local_dir: str | None, revision: str | None = None) -> dict[str, list[dict]]:
    if local_dir is not None:
        missing = [s for s in SPLITS if not (Path(local_dir) / f"{s}.jsonl").is_file()]
        if missing:
            raise FileNotFoundError(f"--local_dir {local_dir} lacks {[f'{s}.jsonl' for s in missing]}")
        return {s: read_jsonl(Path(local_dir) / f"{s}.jsonl") for s in SPLITS}
    return read_hub_splits(revision)


def read_hub_splits(revision: str | None) -> dict[str, list[dict]]:
    """{split: [{"question", "answer"}, ...]} from the Hub dataset's parquet files."""
    snapshot = download_snapshot(
        HUB_DATASET,
        repo_type="dataset",
        revision=revision,
        allow_patterns=[f"main/{s}-*.parquet" for s in SPLITS],
    )
    splits = {}
    for split in SPLITS:
        files = sorted(snapshot.glob(f"main/{split}-*.parquet"))
        if not files:
            raise FileNotFoundError(f"{HUB_DATASET} snapshot {snapshot} has no main/{split}-*.parquet")
        splits[split] = [
            {"question": row["question"], "answer": row["answer"]}
            for file in files
            for row in pq.read_table(file, columns=["question", "answer"]).to_pylist()
        ]
    return splits


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--local_dir", help="directory with GSM8K train.jsonl and test.jsonl")
    parser.add_argument("--out", required=True, help="output directory for train/test parquet")
    parser.add_argument("--revision", help=f"branch, tag or commit of {HUB_DATASET} (default: main)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        splits = load_records(args.local_dir, args.revision)
    except (ValueError, FileNotFoundError) as err:
        raise SystemExit(f"error: {err}") from None
    for split, records in splits.items():
        rows = [to_row(record, split, i) for i, record in enumerate(records)]
        pq.write_table(pa.Table.from_pylist(rows), out / f"{split}.parquet")
        print(f"wrote {len(rows)} rows to {out / f'{split}.parquet'}")


if __name__ == "__main__":
    main()
