"""MATH-style rule reward: the response's final answer, the content of its last \\boxed{...} (the
format of MATH's reference solutions, which the prompt asks for), compared with the ground truth
symbolically by math-verify (Hugging Face's maintained answer checker: LaTeX -> SymPy, so
`\\frac{1}{2}`, `0.5` and `\\dfrac12` are the same answer), not by string equality.
"""

BOXED = "\\boxed"


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text` (nested braces kept), or None."""
    start = text.rfind(BOXED + "{")
    if start < 0:
        return None
    depth, begin = 0, start + len(BOXED)
    for pos in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[pos], 0)
        if depth == 0:
            return text[begin + 1 : pos]
    return None  # unbalanced: the response was cut off inside the box


def compute_score(
    solution_str: str, ground_truth: str, format_score: float = 0.0, score: float = 1.0
) -> float:
    """`score` when the last boxed answer equals `ground_truth` (LaTeX) mathematically;
    `format_score` when there is a boxed answer that is wrong or unreadable; 0 without one."""
    from math_verify import parse, verify

    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    # math-verify reads both sides as boxed LaTeX; an unparsable side is an empty list, never equal
    gold, predicted = parse(f"${BOXED}{{{ground_truth}}}$"), parse(f"${BOXED}{{{answer}}}$")
    return score if gold and predicted and verify(gold, predicted) else format_score
