"""Arithmetic word problems in the GSM8K row format, for the quickstart and the tests.

"What is 23+48?" has the reference answer "23+48=71\\n#### 71": the working, then GSM8K's
"#### <number>" final line, so the GSM8K rule reward scores it unchanged (`data_source` is
"arith", which the reward registry maps to the GSM8K rule). Train and held-out test problems are
disjoint; the same seed always writes the same files.

    python scripts/make_arith_data.py --out outputs/data/arith
"""

import random
from dataclasses import dataclass, field
from pathlib import Path

DATA_SOURCE = "arith"
OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass
class ArithConfig:
    """Which problems are generated. Defaults: two-digit addition, 4,000 train / 200 test rows."""

    num_train: int = 4000
    num_test: int = 200
    min_operand: int = 10
    max_operand: int = 99  # inclusive
    operators: list[str] = field(default_factory=lambda: ["+"])
    seed: int = 0

    def validate(self) -> None:
        unknown = [op for op in self.operators if op not in OPERATORS]
        if unknown or not self.operators:
            raise ValueError(
                f"operators must be a non-empty subset of {list(OPERATORS)}, got {self.operators}"
            )
        if not 0 <= self.min_operand <= self.max_operand:
            raise ValueError(
                f"need 0 <= min_operand <= max_operand, got min_operand={self.min_operand}, "
                f"max_operand={self.max_operand}"
            )
        if self.num_train <= 0 or self.num_test <= 0:
            raise ValueError(
                f"num_train and num_test must be positive, got {self.num_train}, {self.num_test}"
            )
        distinct = (self.max_operand - self.min_operand + 1) ** 2 * len(self.operators)
        if self.num_test >= distinct:
            raise ValueError(
                f"num_test={self.num_test} leaves no problems for training: only {distinct} distinct "
                "problems exist for this operand range; lower num_test or widen the range"
            )


def solve(a: int, op: str, b: int) -> str:
    """The reference answer text: working line, then GSM8K's final-answer line."""
    result = OPERATORS[op](a, b)
    return f"{a}{op}{b}={result}\n#### {result}"


def make_row(a: int, op: str, b: int, split: str, index: int) -> dict:
    """One row in the GSM8K parquet layout (verl's): chat `prompt`, rule `reward_model`, and the
    full reference answer in `extra_info` for supervised warm starts."""
    question = f"What is {a}{op}{b}?"
    answer = solve(a, op, b)
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer.rsplit("#### ", 1)[1]},
        "extra_info": {"split": split, "index": index, "question": question, "answer": answer},
    }


def make_splits(cfg: ArithConfig) -> dict[str, list[dict]]:
    """Train and test rows. The test problems are drawn first and never appear in train; train
    rows are sampled with replacement from the rest, so num_train may exceed the distinct count."""
    cfg.validate()
    rng = random.Random(cfg.seed)
    operands = range(cfg.min_operand, cfg.max_operand + 1)
    problems = [(a, op, b) for op in cfg.operators for a in operands for b in operands]
    rng.shuffle(problems)
    test, rest = problems[: cfg.num_test], problems[cfg.num_test :]
    train = [rng.choice(rest) for _ in range(cfg.num_train)]
    return {
        "train": [make_row(a, op, b, "train", i) for i, (a, op, b) in enumerate(train)],
        "test": [make_row(a, op, b, "test", i) for i, (a, op, b) in enumerate(test)],
    }


def write_arith_parquet(out_dir: str | Path, cfg: ArithConfig | None = None) -> dict[str, Path]:
    """Writes `train.parquet` and `test.parquet` under `out_dir`; returns their paths by split."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    splits = make_splits(cfg or ArithConfig())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in splits.items():
        paths[split] = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), paths[split])
    return paths
