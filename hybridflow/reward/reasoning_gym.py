"""The rule reward of reasoning-gym rows (data_source `reasoning_gym/<task>`, written by
hybridflow/data/reasoning_gym.py): the task's own `score_answer` on the response's answer.

The answer is the text of the response's last `<answer>...</answer>` (reasoning-gym's own
`extract_answer`, what its system prompts ask for); a response without one scores 0. The row's
ground truth names the item (task, seed, size, index, settings), which is generated again and
passed to `score_answer` as generated. Scores are the task's: 1.0 for a right answer, some tasks
give partial credit (e.g. an answer that contains the right one).

A task's `score_answer` that raises on a model's answer (a scorer parsing free text) scores it 0,
with a warning naming the task and the error the first time each occurs: an unreadable answer is a
wrong answer, and one odd response should not stop the run.
"""

import json
import logging

from hybridflow.data.reasoning_gym import item_at

logger = logging.getLogger(__name__)
_warned: set[tuple[str, str]] = set()


def compute_score(solution_str: str, ground_truth: str, format_score: float = 0.0) -> float:
    """`score_answer(answer, item)` of the item `ground_truth` (a JSON locator) names; 0 without an
    `<answer>` tag, at least `format_score` with one."""
    from reasoning_gym.utils import extract_answer

    dataset, entry = item_at(json.loads(ground_truth))
    answer = extract_answer(solution_str, tag_name="answer")
    if answer is None:
        return 0.0
    try:
        score = float(dataset.score_answer(answer, entry))
    except Exception as err:  # the task's scorer on free text: see the docstring
        warn_once(entry["metadata"].get("source_dataset", type(dataset).__name__), err)
        score = 0.0
    return max(score, format_score)


def warn_once(task: str, err: Exception) -> None:
    key = (task, type(err).__name__)
    if key not in _warned:
        _warned.add(key)
        logger.warning("reasoning-gym's %s score_answer raised %r on an answer: scored 0", task, err)
