"""Writes GSM8K as hybridflow prompt rows: <out>/train.parquet and <out>/test.parquet.

    python scripts/prepare_gsm8k.py --local_dir ../shared/data/gsm8k --out data/gsm8k   # the shared copy
    python scripts/prepare_gsm8k.py --out data/gsm8k        # downloads with HF `datasets` (network)

`--local_dir` holds GSM8K's original train.jsonl and test.jsonl.
"""

import argparse
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from hybridflow.data.gsm8k import read_jsonl, to_row

SPLITS = ("train", "test")


def load_records(local_dir: str | None) -> dict[str, list[dict]]:
    if local_dir is not None:
        missing = [s for s in SPLITS if not (Path(local_dir) / f"{s}.jsonl").is_file()]
        if missing:
            raise FileNotFoundError(f"--local_dir {local_dir} lacks {[f'{s}.jsonl' for s in missing]}")
        return {s: read_jsonl(Path(local_dir) / f"{s}.jsonl") for s in SPLITS}
    try:
        import datasets
    except ImportError as err:
        raise SystemExit(
            "without --local_dir, `pip install datasets` (and network access) is needed"
        ) from err
    hub = datasets.load_dataset("openai/gsm8k", "main")
    return {s: list(hub[s]) for s in SPLITS}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--local_dir", help="directory with GSM8K train.jsonl and test.jsonl")
    parser.add_argument("--out", required=True, help="output directory for train/test parquet")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, records in load_records(args.local_dir).items():
        rows = [to_row(record, split, i) for i, record in enumerate(records)]
        pq.write_table(pa.Table.from_pylist(rows), out / f"{split}.parquet")
        print(f"wrote {len(rows)} rows to {out / f'{split}.parquet'}")


if __name__ == "__main__":
    main()
