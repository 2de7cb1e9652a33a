"""The protocol every rollout handle follows (see the package docstring)."""

from typing import Protocol

from hybridflow.protocol import DataProto
from hybridflow.trainer.policy import Policy


class Rollout(Protocol):
    def sync_weights(self, policy: Policy) -> None:
        """From now on the engines generate with `policy`'s current weights (version
        `policy.version`); nothing moves where they serve that version already."""

    def responses(self, rows: DataProto, steps_left: int) -> DataProto:
        """The training step's responses to `rows`; `steps_left`: steps after this one, so a
        rollout generating ahead launches nothing past the run's end."""

    def generate(self, rows: DataProto) -> DataProto:
        """Responses to `rows` now, with the weights last synced (validation, baselines)."""

    def metrics(self, batch: DataProto) -> dict[str, float]:
        """The rollout's metrics of a batch just trained on."""

    def save(self, path: str) -> None:
        """What the rollout holds into the directory `path` (it exists)."""

    def load(self, path: str) -> None:
        """What `save` wrote; the engines get the weights at the next sync."""
