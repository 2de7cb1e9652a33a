"""An OpenEnv environment for the tests, served by OpenEnv's own server (`create_app`, uvicorn:
tests/agents/openenv_server.py starts it), with the rules of letters_game.py: each step's reward is
the share of the action's characters that are ASCII letters; the episode ends after STEPS steps.
Every step is appended to the JSON-lines file named by $LETTERS_LOG (when set), so a test can check
what the trainer got against what the server gave."""

import json
import os
import threading
import uuid

from letters_game import STEPS, TASK, letter_share
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

_log_lock = threading.Lock()


class LettersAction(Action):
    message: str


class LettersObservation(Observation):
    text: str = ""


class LettersEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)
        self.seed, self.episode = None, None

    def reset(self, seed=None, episode_id=None, **kwargs) -> LettersObservation:
        self._state, self.seed = State(episode_id=episode_id, step_count=0), seed
        self.episode = uuid.uuid4().hex
        return LettersObservation(text=f"{TASK} (task {seed})", done=False, reward=None)

    def step(self, action: LettersAction, timeout_s=None, **kwargs) -> LettersObservation:
        self._state.step_count += 1
        reward, done = letter_share(action.message), self._state.step_count >= STEPS
        _log(
            {
                "episode": self.episode,
                "seed": self.seed,
                "step": self._state.step_count,
                "action": action.message,
                "reward": reward,
            }
        )
        text = f"Step {self._state.step_count}: {reward:.2f} of your reply was letters."
        return LettersObservation(text=text, done=done, reward=reward)

    @property
    def state(self) -> State:
        return self._state


def _log(record: dict) -> None:
    path = os.environ.get("LETTERS_LOG")
    if path:
        with _log_lock, open(path, "a") as log:
            log.write(json.dumps(record) + "\n")


app = create_app(
    LettersEnvironment, LettersAction, LettersObservation, env_name="letters", max_concurrent_envs=64
)
