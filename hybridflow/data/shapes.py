"""Shapes in small images, in verl's image-prompt row format: the VLM quickstart's tasks.

Each image is a white square cut into a grid of cells; some cells hold a filled circle, others a
filled square of another colour (distractors), never touching. Three questions:
- "count" asks "<image>How many circles are there?"; the answer is "<n> circles\\n#### <n>".
- "locate" draws one circle and asks "<image>Which cell holds the circle?"; the answer is
  "cell <n>\\n#### <n>", the cells numbered 1.. row by row from the top left.
- "quadrant" draws one circle and asks "<image>Which quadrant holds the circle?"; the answer is
  "quadrant <n>\\n#### <n>", 1-4 row by row from the top left: the task on which the VLM
  quickstart's 20 GRPO steps gain over a partial warm start (docs/vlm.md).
All end on GSM8K's final line, so the GSM8K rule reward scores them unchanged (`data_source`
"shapes", registered in hybridflow.reward.registry). Train and held-out test images are disjoint;
the same seed always writes the same files.

    python scripts/make_shapes_data.py --out outputs/data/shapes [--task quadrant]
"""

import io
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DATA_SOURCE = "shapes"
QUESTIONS = {
    "count": "<image>How many circles are there?",
    "locate": "<image>Which cell holds the circle?",
    "quadrant": "<image>Which quadrant holds the circle?",
}
ANSWERS = {"count": "{} circles", "locate": "cell {}", "quadrant": "quadrant {}"}
BACKGROUND, CIRCLE, SQUARE = (255, 255, 255), (220, 40, 40), (40, 90, 220)
CELL = 8  # pixels per grid cell, the tiny VLM's patch size


@dataclass
class ShapesConfig:
    """Which images are drawn. Defaults: the counting task, 32x32 images (a 4x4 grid), 1-4 circles
    (one to locate), up to 2 squares, 4,000 train / 200 test rows."""

    task: Literal["count", "locate", "quadrant"] = "count"
    num_train: int = 4000
    num_test: int = 200
    image_size: int = 32
    min_circles: int = 1
    max_circles: int | None = None  # inclusive; None: 4 to count, 1 to locate or name the quadrant
    max_squares: int = 2
    seed: int = 0

    @property
    def cells(self) -> int:
        return (self.image_size // CELL) ** 2

    @property
    def most_circles(self) -> int:
        if self.max_circles is not None:
            return self.max_circles
        return 4 if self.task == "count" else 1

    def validate(self) -> None:
        if self.task not in QUESTIONS:
            raise ValueError(f"task must be one of {sorted(QUESTIONS)}, got {self.task!r}")
        if self.task != "count" and (self.min_circles, self.most_circles) != (1, 1):
            raise ValueError(
                f"task {self.task!r} draws exactly one circle; leave min_circles and max_circles unset, "
                f"got {self.min_circles}, {self.max_circles}"
            )
        if self.task == "quadrant" and self.image_size % (2 * CELL):
            raise ValueError(f"task 'quadrant' needs an even grid: image_size a multiple of {2 * CELL}")
        if self.image_size < CELL or self.image_size % CELL:
            raise ValueError(f"image_size must be a positive multiple of {CELL}, got {self.image_size}")
        if not 0 <= self.min_circles <= self.most_circles:
            raise ValueError(
                f"need 0 <= min_circles <= max_circles, got {self.min_circles}, {self.most_circles}"
            )
        if self.most_circles + self.max_squares > self.cells:
            raise ValueError(
                f"max_circles + max_squares = {self.most_circles + self.max_squares} shapes do not fit "
                f"the {self.cells} cells of a {self.image_size}-pixel image; lower them or enlarge it"
            )
        if self.num_train <= 0 or self.num_test <= 0 or self.max_squares < 0:
            raise ValueError(
                f"num_train and num_test must be positive and max_squares >= 0, got {self.num_train}, "
                f"{self.num_test}, {self.max_squares}"
            )


def draw(cfg: ShapesConfig, rng: random.Random) -> tuple[bytes, int]:
    """(PNG bytes, answer) of one random image (`answer_for`); shapes 5 pixels wide, 1-2 pixels inside
    their cell, so shapes in neighbouring cells stay at least 2 pixels apart."""
    from PIL import Image, ImageDraw

    circles = rng.randint(cfg.min_circles, cfg.most_circles)
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
    return out.getvalue(), answer_for(cfg, circles, cells[0])


def answer_for(cfg: ShapesConfig, circles: int, first_circle_cell: int) -> int:
    """The task's answer: the circle count, or the one circle's cell or quadrant, each numbered from
    1 row by row from the top left."""
    if cfg.task == "count":
        return circles
    if cfg.task == "locate":
        return first_circle_cell + 1
    per_row = cfg.image_size // CELL
    row, column = divmod(first_circle_cell, per_row)
    half = per_row // 2  # cells per quadrant side
    return (row // half) * 2 + column // half + 1


def make_row(task: str, png: bytes, truth: int, split: str, index: int) -> dict:
    """One row: chat `prompt` with the image placeholder, `images` as `datasets.Image` writes them,
    the rule `reward_model`, and the full reference answer in `extra_info` for warm starts."""
    answer = ANSWERS[task].format(truth) + f"\n#### {truth}"
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": QUESTIONS[task]}],
        "images": [{"bytes": png, "path": None}],
        "ability": "vision",
        "reward_model": {"style": "rule", "ground_truth": str(truth)},
        "extra_info": {"split": split, "index": index, "question": QUESTIONS[task], "answer": answer},
    }


def make_splits(cfg: ShapesConfig) -> dict[str, list[dict]]:
    """Train and test rows; a drawn train image identical to a test image is drawn again."""
    cfg.validate()
    rng = random.Random(cfg.seed)
    test = [draw(cfg, rng) for _ in range(cfg.num_test)]
    held_out, train = {png for png, _ in test}, []
    while len(train) < cfg.num_train:
        png, truth = draw(cfg, rng)
        if png not in held_out:
            train.append((png, truth))
    return {
        "train": [make_row(cfg.task, png, n, "train", i) for i, (png, n) in enumerate(train)],
        "test": [make_row(cfg.task, png, n, "test", i) for i, (png, n) in enumerate(test)],
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
