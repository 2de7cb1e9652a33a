"""The protocol every rollout handle follows (see the package docstring)."""

from typing import Protocol

from hybridflow.protocol import DataProto
from hybridflow.trainer.policy import Policy
from hybridflow.trainer.prompts import PromptBatches, StepPrompts


class Rollout(Protocol):
    def sync_weights(self, policy: Policy) -> None:
        """From now on the engines generate with `policy`'s current weights (version
        `policy.version`); nothing moves where they serve that version already."""

    def responses(self, prompts: PromptBatches, steps_left: int) -> tuple[StepPrompts, DataProto]:
        """The training step's prompts and their responses: the loader's next batch (`prompts.next()`)
        or, for a rollout that streams, the prompts of the groups it finished; `steps_left`: steps
        after this one, so a rollout generating ahead launches nothing past the run's end."""

    def generate(self, rows: DataProto) -> DataProto:
        """Responses to `rows` now, with the weights last synced (validation, baselines)."""

    def metrics(self, batch: DataProto) -> dict[str, float]:
        """The rollout's metrics of a batch just trained on."""

    def save(self, path: str) -> None:
        """What the rollout holds into the directory `path` (it exists)."""

    def load(self, path: str) -> None:
        """What `save` wrote; the engines get the weights at the next sync."""
