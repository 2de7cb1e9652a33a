"""Writes the arithmetic train/test parquet files used by the quickstart.

python scripts/make_arith_data.py --out outputs/data/arith [--num-train 4000 --operators + -]
"""

import argparse

from hybridflow.data.arith import ArithConfig, write_arith_parquet


def main() -> None:
    defaults = ArithConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for train.parquet and test.parquet")
    parser.add_argument("--num-train", type=int, default=defaults.num_train)
    parser.add_argument("--num-test", type=int, default=defaults.num_test)
    parser.add_argument("--min-operand", type=int, default=defaults.min_operand)
    parser.add_argument("--max-operand", type=int, default=defaults.max_operand)
    parser.add_argument("--operators", nargs="+", default=defaults.operators)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    args = vars(parser.parse_args())
    out = args.pop("out")
    for split, path in write_arith_parquet(out, ArithConfig(**args)).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
