"""Counting shapes in small images, in verl's image-prompt row format: the VLM quickstart's task.

Each image is a white square cut into a grid of cells; some cells hold a filled circle, others a
filled square of another colour (distractors), never touching. The prompt asks "<image>How many
circles are there?" and the reference answer is "<n> circles\\n#### <n>": GSM8K's final line, so
the GSM8K rule reward scores it unchanged (`data_source` "shapes", registered in
hybridflow.reward.registry). Train and held-out test images are disjoint; the same seed always
writes the same files.

    python scripts/make_shapes_data.py --out outputs/data/shapes
"""

import io
import random
from dataclasses import dataclass
from pathlib import Path

DATA_SOURCE = "shapes"
QUESTION = "<image>How many circles are there?"
BACKGROUND, CIRCLE, SQUARE = (255, 255, 255), (220, 40, 40), (40, 90, 220)
CELL = 8  # pixels per grid cell, the tiny VLM's patch size


@dataclass
class ShapesConfig:
    """Which images are drawn. Defaults: 32x32 images (a 4x4 grid), 1-4 circles, up to 2 squares,
    4,000 train / 200 test rows."""

    num_train: int = 4000
    num_test: int = 200
    image_size: int = 32
    min_circles: int = 1
    max_circles: int = 4  # inclusive
    max_squares: int = 2
    seed: int = 0

    @property
    def cells(self) -> int:
        return (self.image_size // CELL) ** 2

    def validate(self) -> None:
        if self.image_size < CELL or self.image_size % CELL:
            raise ValueError(f"image_size must be a positive multiple of {CELL}, got {self.image_size}")
        if not 0 <= self.min_circles <= self.max_circles:
            raise ValueError(
                f"need 0 <= min_circles <= max_circles, got {self.min_circles}, {self.max_circles}"
            )
        if self.max_circles + self.max_squares > self.cells:
            raise ValueError(
                f"max_circles + max_squares = {self.max_circles + self.max_squares} shapes do not fit "
                f"the {self.cells} cells of a {self.image_size}-pixel image; lower them or enlarge it"
            )
        if self.num_train <= 0 or self.num_test <= 0 or self.max_squares < 0:
            raise ValueError(
                f"num_train and num_test must be positive and max_squares >= 0, got {self.num_train}, "
                f"{self.num_test}, {self.max_squares}"
            )


def draw(cfg: ShapesConfig, rng: random.Random) -> tuple[bytes, int]:
    """(PNG bytes, circle count) of one random image: shapes 5 pixels wide, 1-2 pixels inside their
    cell, so shapes in neighbouring cells stay at least 2 pixels apart."""
    from PIL import Image, ImageDraw

    circles = rng.randint(cfg.min_circles, cfg.max_circles)
    squares = rng.randint(0, cfg.max_squares)
    cells = rng.sample(range(cfg.cells), circles + squares)
    image = Image.new("RGB", (cfg.image_size, cfg.image_size), BACKGROUND)
    pen, per_row = ImageDraw.Draw(image), cfg.image_size // CELL
    for index, cell in enumerate(cells):
        left = (cell % per_row) * CELL + rng.randint(1, 2)
        top = (cell // per_row) * CELL + rng.randint(1, 2)
        box = (left, top, left + 4, top + 4)  # 5x5 pixels, inclusive
        if index < circles:
            pen.ellipse(box, fill=CIRCLE)
        else:
            pen.rectangle(box, fill=SQUARE)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue(), circles


def make_row(png: bytes, circles: int, split: str, index: int) -> dict:
    """One row: chat `prompt` with the image placeholder, `images` as `datasets.Image` writes them,
    the rule `reward_model`, and the full reference answer in `extra_info` for warm starts."""
    answer = f"{circles} circles\n#### {circles}"
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": QUESTION}],
        "images": [{"bytes": png, "path": None}],
        "ability": "vision",
        "reward_model": {"style": "rule", "ground_truth": str(circles)},
        "extra_info": {"split": split, "index": index, "question": QUESTION, "answer": answer},
    }


def make_splits(cfg: ShapesConfig) -> dict[str, list[dict]]:
    """Train and test rows; a drawn train image identical to a test image is drawn again."""
    cfg.validate()
    rng = random.Random(cfg.seed)
    test = [draw(cfg, rng) for _ in range(cfg.num_test)]
    held_out, train = {png for png, _ in test}, []
    while len(train) < cfg.num_train:
        png, circles = draw(cfg, rng)
        if png not in held_out:
            train.append((png, circles))
    return {
        "train": [make_row(png, n, "train", i) for i, (png, n) in enumerate(train)],
        "test": [make_row(png, n, "test", i) for i, (png, n) in enumerate(test)],
    }


def write_shapes_parquet(out_dir: str | Path, cfg: ShapesConfig | None = None) -> dict[str, Path]:
    """Writes `train.parquet` and `test.parquet` under `out_dir`; returns their paths by split."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in make_splits(cfg or ShapesConfig()).items():
        paths[split] = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), paths[split])
    return paths
