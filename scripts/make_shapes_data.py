"""Writes the shapes image train/test parquet files (the VLM tasks, hybridflow/data/shapes.py).

python scripts/make_shapes_data.py --out outputs/data/shapes [--task quadrant] [--num-train 4000]
"""

import argparse

from hybridflow.data.shapes import QUESTIONS, ShapesConfig, write_shapes_parquet


def main() -> None:
    defaults = ShapesConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for train.parquet and test.parquet")
    parser.add_argument(
        "--task",
        choices=sorted(QUESTIONS),
        default=defaults.task,
        help="how many circles, or which cell or quadrant holds the one circle",
    )
    # --max-circles left out (None) takes the task's own: 4 to count, 1 otherwise
    for name in ("num_train", "num_test", "image_size", "min_circles", "max_circles", "max_squares", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    args = vars(parser.parse_args())
    out = args.pop("out")
    for split, path in write_shapes_parquet(out, ShapesConfig(**args)).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
