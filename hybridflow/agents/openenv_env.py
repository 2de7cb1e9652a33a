"""`rollout.agent.environment.name: openenv`: episodes against an OpenEnv environment server
(the `openenv-core` package; an environment built with its `create_app` and served by uvicorn).

Each episode opens its own session on the server's WebSocket endpoint (`/ws`, OpenEnv's
`GenericEnvClient`): the server gives every session an environment instance of its own, so the
rows of a generation call play at once (the server's `max_concurrent_envs` must allow that many,
or set `rollout.agent.environment.max_concurrent_episodes`). The action sent is
`{action_field: <the turn's text>}`; the text the model reads is the observation's
`observation_field`, or every field of it as JSON when that is "". A step without a reward counts 0.

`check_server(cfg)` is the recipe check, run before any worker starts: the server answers
`/health`, and its `/schema` has the action and observation fields the recipe names.
`openenv` is imported where an episode opens, never at import time.
"""

import json
import urllib.error
import urllib.request
from typing import Any

from engines.rollout.config import EnvironmentConfig
from hybridflow.agents.environments import Environment, StepResult

KEY = "rollout.agent.environment"


class OpenEnvEnvironment:
    """One episode's session on an OpenEnv server (the `Environment` protocol)."""

    def __init__(self, cfg: EnvironmentConfig):
        from openenv.core.generic_client import GenericEnvClient

        self.cfg = cfg
        self.client = GenericEnvClient(
            base_url=cfg.url, connect_timeout_s=cfg.connect_timeout_s, message_timeout_s=cfg.step_timeout_s
        )

    async def reset(self, seed: int) -> str:
        result = await self.client.reset(seed=seed)
        return self.observation_text(result.observation)

    async def step(self, action: str) -> StepResult:
        result = await self.client.step({self.cfg.action_field: action})
        reward = 0.0 if result.reward is None else float(result.reward)
        return StepResult(self.observation_text(result.observation), reward, bool(result.done))

    async def close(self) -> None:
        await self.client.close()

    def observation_text(self, observation: dict[str, Any]) -> str:
        """The observation's `observation_field` as text, or all of it as JSON."""
        name = self.cfg.observation_field
        if not name:
            return json.dumps(observation, sort_keys=True)
        if name not in observation:
            raise KeyError(
                f"{KEY}.observation_field={name!r}: the observation of {self.cfg.url} has the fields "
                f"{sorted(observation)}; set it to one of them, or to '' for all of them"
            )
        value = observation[name]
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def open_environment(cfg: EnvironmentConfig) -> Environment:
    """A new session of the recipe's environment (one per episode)."""
    return OpenEnvEnvironment(cfg)


def get_json(url: str, timeout_s: float) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read())


def check_server(cfg: EnvironmentConfig) -> None:
    """ValueError naming `rollout.agent.environment.url` unless an OpenEnv server answers there
    (within connect_timeout_s) with an action schema that has `action_field` and, when set, an
    observation schema that has `observation_field`."""
    if not cfg.url.startswith(("http://", "https://")):
        raise ValueError(
            f"{KEY}.url={cfg.url!r} must be an http:// or https:// URL, e.g. http://127.0.0.1:8000"
        )
    base = cfg.url.rstrip("/")
    try:
        health = get_json(f"{base}/health", cfg.connect_timeout_s)
        schema = get_json(f"{base}/schema", cfg.connect_timeout_s)
    except (OSError, ValueError) as err:  # refused, unreachable, timed out, not JSON
        raise ValueError(
            f"{KEY}.url={cfg.url}: no OpenEnv server answers there ({type(err).__name__}: {err}); start "
            "the environment's server (e.g. `uvicorn my_env.server.app:app --port 8000`) or set the url to "
            "its address"
        ) from None
    if health.get("status") != "healthy":
        raise ValueError(f"{KEY}.url={cfg.url}: the server reports {health!r}, not healthy")
    _check_field(schema, "action", cfg.action_field, f"{KEY}.action_field")
    if cfg.observation_field:
        _check_field(schema, "observation", cfg.observation_field, f"{KEY}.observation_field")


def _check_field(schema: dict[str, Any], part: str, name: str, key: str) -> None:
    fields = sorted(schema.get(part, {}).get("properties", {}))
    if name not in fields:
        raise ValueError(
            f"{key}={name!r}: the server's {part} has no such field (it has {fields}); set one of them"
        )
