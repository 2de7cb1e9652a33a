"""GSM8K rule reward: the number after the last "####" of the response against the ground truth.

Strict format (as in the GSM8K reference answers): only "#### <number>" counts; commas and "$"
inside the number are ignored ("#### $1,200" reads as 1200).
"""

import re

# Searching only the tail keeps the cost flat for long responses; the answer sits at the end.
TAIL_CHARS = 300
ANSWER = re.compile(r"####\s*(-?[$0-9.,]+)")


def extract_answer(response: str) -> str | None:
    """The last "#### <number>" of the response as a plain number string, or None."""
    matches = ANSWER.findall(response[-TAIL_CHARS:])
    if not matches:
        return None
    number = matches[-1].replace(",", "").replace("$", "").rstrip(".")
    return number if any(ch.isdigit() for ch in number) else None


def compute_score(
    solution_str: str, ground_truth: str, format_score: float = 0.0, score: float = 1.0
) -> float:
    """`score` when the extracted answer equals the ground truth; `format_score` when the
    response has a "#### <number>" answer that is wrong; 0 when it has none."""
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    return score if answer == ground_truth.replace(",", "") else format_score
