"""The shapes image tasks (hybridflow/data/shapes.py): each row's answer is the number of circles
its image shows, or the cell of its one circle, read here from the pixels; splits are disjoint and
seeded; the reward and the VLM's processor read the rows."""

import io
import subprocess
import sys
from collections import deque

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from hybridflow.data.prompt_dataset import PromptDataset
from hybridflow.data.sft_dataset import SFTDataset, collate_sft
from hybridflow.data.shapes import BACKGROUND, CELL, CIRCLE, SQUARE, ShapesConfig, make_splits
from hybridflow.reward.registry import rule_reward_fn
from hybridflow.utils.tiny_vlm import make_tiny_vlm

SMALL = ShapesConfig(num_train=150, num_test=40)


def components(mask: np.ndarray) -> int:
    """Connected regions (4-neighbour) of True pixels, by flood fill."""
    seen, count = np.zeros_like(mask), 0
    for start in zip(*np.nonzero(mask), strict=True):
        if seen[start]:
            continue
        count, queue = count + 1, deque([start])
        seen[start] = True
        while queue:
            y, x = queue.popleft()
            for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                inside = 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1]
                if inside and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    queue.append((ny, nx))
    return count


def pixels(row: dict) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB"))  # (H, W, 3)


def is_colour(image: np.ndarray, colour) -> np.ndarray:
    return (image == np.array(colour)).all(-1)  # (H, W)


@pytest.fixture(scope="module")
def splits():
    return make_splits(SMALL)


def test_each_answer_is_the_number_of_circles_in_the_image(splits):
    for row in splits["train"] + splits["test"]:
        image = pixels(row)
        circles, squares = components(is_colour(image, CIRCLE)), components(is_colour(image, SQUARE))
        assert row["reward_model"]["ground_truth"] == str(circles)
        assert row["extra_info"]["answer"].endswith(f"#### {circles}")
        assert SMALL.min_circles <= circles <= 4 and squares <= SMALL.max_squares
        # shapes never touch: the non-background pixels form exactly circles + squares regions
        assert components(~is_colour(image, BACKGROUND)) == circles + squares


def test_every_count_and_distractors_occur(splits):
    counts = {row["reward_model"]["ground_truth"] for row in splits["train"]}
    assert counts == {str(n) for n in range(1, 5)}
    assert any(components(is_colour(pixels(row), SQUARE)) for row in splits["train"])


@pytest.mark.parametrize(
    ("task", "question", "word", "answers"),
    [
        ("locate", "Which cell holds the circle?", "cell", range(1, 17)),
        ("quadrant", "Which quadrant holds the circle?", "quadrant", range(1, 5)),
    ],
)
def test_locating_tasks_answer_where_the_one_circle_is(task, question, word, answers):
    cfg, seen = ShapesConfig(task=task, num_train=300, num_test=40), set()
    for row in (row for rows in make_splits(cfg).values() for row in rows):
        image = pixels(row)
        assert components(is_colour(image, CIRCLE)) == 1 and components(is_colour(image, SQUARE)) <= 2
        ys, xs = np.nonzero(is_colour(image, CIRCLE))
        row_cell, column_cell = int(ys.mean() // CELL), int(xs.mean() // CELL)  # of the 4x4 grid
        expected = {
            "locate": row_cell * 4 + column_cell + 1,
            "quadrant": (row_cell // 2) * 2 + column_cell // 2 + 1,
        }[task]
        assert row["reward_model"]["ground_truth"] == str(expected)
        assert row["extra_info"]["answer"] == f"{word} {expected}\n#### {expected}"
        assert row["prompt"][0]["content"] == f"<image>{question}"
        seen.add(expected)
    assert seen == set(answers)


def test_splits_are_disjoint_and_seeded(splits):
    images = {split: [row["images"][0]["bytes"] for row in rows] for split, rows in splits.items()}
    assert not set(images["train"]) & set(images["test"])
    assert make_splits(SMALL)["test"][0]["images"] == splits["test"][0]["images"]
    other = make_splits(ShapesConfig(num_train=150, num_test=40, seed=1))
    assert other["test"][0]["images"] != splits["test"][0]["images"]


def test_the_gsm8k_rule_scores_the_reference_answer_and_not_a_wrong_count(splits):
    score, row = rule_reward_fn(), splits["test"][0]
    truth, answer = row["reward_model"]["ground_truth"], row["extra_info"]["answer"]
    assert score("shapes", answer, truth, {}) == 1.0
    assert score("shapes", f"#### {int(truth) + 1}", truth, {}) == 0.0


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"max_circles": 15, "max_squares": 2}, r"max_circles \+ max_squares = 17 shapes do not fit"),
        ({"image_size": 30}, "image_size must be a positive multiple of 8"),
        ({"task": "locate", "max_circles": 2}, "task 'locate' draws exactly one circle"),
        ({"task": "quadrant", "image_size": 24}, "task 'quadrant' needs an even grid"),
        ({"task": "where"}, r"task must be one of \['count', 'locate', 'quadrant'\], got 'where'"),
    ],
)
def test_settings_that_cannot_be_drawn_are_refused_by_name(change, named):
    with pytest.raises(ValueError, match=named):
        make_splits(ShapesConfig(**change))


def test_script_writes_files_the_vlm_processor_and_the_sft_dataset_read(tmp_path):
    from transformers import AutoProcessor

    out = tmp_path / "shapes"
    cmd = [
        sys.executable,
        "scripts/make_shapes_data.py",
        "--out",
        str(out),
        "--num-train",
        "20",
        "--num-test",
        "5",
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    assert pq.read_table(out / "train.parquet").num_rows == 20
    quadrant = [*cmd, "--task", "quadrant", "--out", str(tmp_path / "quadrant")]
    subprocess.run(quadrant, check=True, capture_output=True)
    located = pq.read_table(tmp_path / "quadrant" / "test.parquet").to_pylist()[0]
    assert located["extra_info"]["answer"].startswith("quadrant ")
    vlm = make_tiny_vlm(tmp_path / "vlm")
    processor = AutoProcessor.from_pretrained(vlm)
    dataset = PromptDataset([str(out / "test.parquet")], processor.tokenizer, 64, processor=processor)
    item = dataset[0]
    image_token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    assert len(dataset) == 5 and (item["input_ids"] == image_token).sum() == 16  # 4x4 patches, CLS dropped
    assert item["pixel_values"].shape == (1, 3, 32, 32)
    sft = SFTDataset([str(out / "test.parquet")], processor.tokenizer, 64, 24, processor=processor)
    batch = collate_sft([sft[i] for i in range(2)], processor.tokenizer.pad_token_id)
    assert len(batch["pixel_values"]) == 2 and batch["pixel_values"][0].shape == (1, 3, 32, 32)
    answer = processor.tokenizer.decode(batch["responses"][0][batch["response_mask"][0].bool()])
    assert answer.startswith(pq.read_table(out / "test.parquet").to_pylist()[0]["extra_info"]["answer"])
