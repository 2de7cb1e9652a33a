"""Writes the tiny random model (Qwen2 by default) used by the tests and the quickstart.

python scripts/make_tiny_model.py --out outputs/tiny_model [--arch qwen2 --num-layers 4 --hidden-size 128 ...]
"""

import argparse
from dataclasses import fields

from hybridflow.utils.tiny_model import ARCHS, TinyModelConfig, make_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", required=True, help="directory to write the Hugging Face model into")
    for f in fields(TinyModelConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif f.name == "arch":
            parser.add_argument(flag, choices=ARCHS, default=f.default)
        else:
            parser.add_argument(flag, type=f.type, default=f.default)
    args = vars(parser.parse_args())
    out = make_tiny_model(args.pop("out"), **args)
    print(f"tiny model written to {out}")


if __name__ == "__main__":
    main()
