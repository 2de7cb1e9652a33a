"""The rules of the tests' letters environment (_openenv_letters.py serves them with OpenEnv), kept
apart so that tests read them without importing OpenEnv (and Gradio with it) at collection."""

STEPS = 2  # steps of an episode
TASK = "Reply with letters only."  # the first observation, before "(task <seed>)"


def letter_share(text: str) -> float:
    """The share of `text`'s characters that are ASCII letters (0 for an empty text): a step's reward."""
    return sum(c.isascii() and c.isalpha() for c in text) / len(text) if text else 0.0
