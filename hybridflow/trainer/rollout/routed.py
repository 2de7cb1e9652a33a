"""Tool-agent loops on a rollout pool (trainer.placement=disaggregated, rollout.agent.loop: tool):
the loops run on the driver, and each turn is one request that the router (router.py) sends to a
replica, a rollout process whose engine serves requests as they come (`generate_request`,
engines/rollout/request_batches.py):

    generate(rows):                               a training or validation call
        every row's trajectory is a session "<call's seed>/<row>", the rows' loops run concurrently
        each turn: router.route(session) -> replica; the request's answer, or the replica lost
        a turn lost with its replica (dead, or past trainer.worker_call_timeout_s: killed as hung)
            is routed again, to a live replica, from the same ids and seed
        the lost replicas are restarted (PoolRollout.recover: within rollout.max_engine_restarts,
            with the policy last synced, checked) once every trajectory ended; at once when none is left

Weights move as on any pool (PoolRollout: transfers, versions, restarts, checkpoints). Each row
carries `rollout_replica`, the replica that served its last turn; every request's route is appended
to `<output_dir>/router.jsonl` (a fresh start moves an earlier run's aside; a resume cuts it to its
checkpoint's lines), and the step's metrics add `rollout/router/moved_turns`, the turns routed off
a lost replica since the last step.
"""

import asyncio
import json
from pathlib import Path

import torch

from engines.rollout.base import (
    REPLICA_KEY,
    check_prompts,
    row_seed,
    select_sampling,
    unpadded_prompts,
    without_row_index,
)
from engines.rollout.config import RolloutConfig, SamplingConfig
from engines.rollout.requests import Completion
from hybridflow.agents.batch import trajectories_to_batch
from hybridflow.agents.rollout import ToolLoops
from hybridflow.protocol import DataProto
from hybridflow.single_controller.errors import CallDeadline, call_timeout
from hybridflow.trainer.policy import Policy
from hybridflow.trainer.prompts import PromptBatches, StepPrompts
from hybridflow.trainer.rollout.pool import PoolRollout, count_lines, keep_first_lines
from hybridflow.trainer.rollout.router import Router
from hybridflow.utils.imports import first_line
from hybridflow.utils.tracking import move_aside

ROUTES_FILE = "router.jsonl"
ROUTES_LINES_FILE = "router_lines.json"  # in the rollout's checkpoint part


class RoutedAgentRollout:
    def __init__(
        self, pool: PoolRollout, loops: ToolLoops, cfg: RolloutConfig, pad_token_id: int, output_dir: str,
        request_deadline: CallDeadline,
    ):  # fmt: skip
        self.pool, self.loops, self.cfg, self.pad_token_id = pool, loops, cfg, pad_token_id
        self.router = Router(pool.group.world_size)
        self.request_deadline = request_deadline
        self.routes_file = Path(output_dir) / ROUTES_FILE
        self.routes_begun = False  # a fresh start's router.jsonl moved aside
        self.lost_errors: list[BaseException] = []  # of the replicas lost in the call under way
        self.moved = 0  # turns routed off a lost replica since the last step's metrics

    def sync_weights(self, policy: Policy) -> None:
        self.pool.sync_weights(policy)

    def responses(self, prompts: PromptBatches, steps_left: int) -> tuple[StepPrompts, DataProto]:
        step = prompts.next()
        return step, self.generate(step.rows)

    def generate(self, rows: DataProto) -> DataProto:
        """Every row's trajectory, its turns routed over the pool's replicas."""
        prompts, sampling, seed = call_rows(self.pool.seeded(rows), self.cfg)
        # named by the call's seed: unique in a run, and the same again after a resume
        sessions = [Session(self, f"{seed}/{row}", sampling) for row in range(len(prompts))]
        trajectories = asyncio.run(self.run_sessions(sessions, unpadded_prompts(prompts), seed))
        self.restart_lost()
        self.record(self.router.take_routes())
        batch = trajectories_to_batch(prompts, trajectories, self.cfg.response_length, self.pad_token_id)
        versions = batch.batch["rollout_versions"]  # (B, R): -1 on tool tokens and padding
        oldest = versions.masked_fill(versions < 0, torch.iinfo(versions.dtype).max).min(dim=1).values  # (B,)
        batch.batch["policy_version"] = oldest
        batch.batch[REPLICA_KEY] = torch.tensor([session.replica for session in sessions], dtype=torch.long)
        return batch

    async def run_sessions(self, sessions: list["Session"], prompt_ids: list[list[int]], seed: int) -> list:
        run_tools = self.loops.tool_runner()  # its bound is this call's: one event loop each
        runs = [
            self.loops.loop(session.generate, run_tools).run(ids, row_seed(seed, row))
            for row, (session, ids) in enumerate(zip(sessions, prompt_ids, strict=True))
        ]
        return await asyncio.gather(*runs)

    async def request(
        self, replica: int, ids: list[int], sampling: SamplingConfig, seed: int, max_new_tokens: int
    ) -> Completion | None:
        """The replica's answer to one request; None when the replica was lost meanwhile (its
        process died, or it passed the request deadline and was killed as hung)."""
        import ray.exceptions

        group = self.pool.group
        call = group.call_rank_async(replica, "generate_request", ids, sampling, seed, max_new_tokens)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(call.future()), self.request_deadline.seconds)
        except ray.exceptions.RayActorError as err:
            self.lose(replica, err)
        except TimeoutError:
            hung = call_timeout("rollout replica", replica, "generate_request", self.request_deadline)
            group.kill_rank(replica)
            self.lose(replica, hung)
        return None

    def lose(self, replica: int, err: BaseException) -> None:
        """The replica serves no more requests; its sessions move to the live ones."""
        if replica in self.router.live:
            print(f"rollout router: replica {replica} lost ({first_line(err)}); sessions move", flush=True)
            self.router.lost(replica)
            self.lost_errors.append(err)

    def restart_lost(self) -> None:
        """The replicas lost in this call restarted with the policy last synced (checked)."""
        if self.lost_errors:
            cause, self.lost_errors = self.lost_errors[0], []
            self.router.restored(self.pool.recover(cause))

    def record(self, routes: list[dict]) -> None:
        """The call's routes appended to router.jsonl; a fresh start's first moves an earlier run's aside."""
        if not self.routes_begun:
            self.routes_begun = True
            move_aside(self.routes_file)
        self.moved += sum(route["moved"] for route in routes)
        with self.routes_file.open("a") as out:
            out.writelines(json.dumps(route) + "\n" for route in routes)

    def metrics(self, batch: DataProto) -> dict[str, float]:
        moved, self.moved = self.moved, 0
        return {**self.pool.metrics(batch), "rollout/router/moved_turns": float(moved)}

    def save(self, path: str) -> None:
        """The pool's state, and how many lines router.jsonl has."""
        self.pool.save(path)
        (Path(path) / ROUTES_LINES_FILE).write_text(json.dumps({"lines": count_lines(self.routes_file)}))

    def load(self, path: str) -> None:
        """The pool's state; router.jsonl cut to the checkpoint's lines (appended to from now on)."""
        self.pool.load(path)
        lines = Path(path) / ROUTES_LINES_FILE
        if lines.is_file():
            keep_first_lines(self.routes_file, json.loads(lines.read_text())["lines"])
        self.routes_begun = True


class Session:
    """One trajectory's turns, each routed to a replica (the one of its last turn while it lives)."""

    def __init__(self, owner: RoutedAgentRollout, name: str, sampling: SamplingConfig):
        self.owner, self.name, self.sampling = owner, name, sampling
        self.turns = 0
        self.replica = -1  # the replica that served the last turn

    async def generate(self, ids: list[int], seed: int, max_new_tokens: int) -> Completion:
        turn, self.turns = self.turns, self.turns + 1
        router, tokens = self.owner.router, len(ids) + max_new_tokens
        while True:
            if not router.live:  # every replica lost: restarted now, the loops waiting
                self.owner.restart_lost()
            replica = router.route(self.name, turn, tokens)
            try:
                completion = await self.owner.request(replica, ids, self.sampling, seed, max_new_tokens)
            finally:
                router.finished(replica, tokens)
            if completion is not None:
                self.replica = replica
                return completion


def call_rows(rows: DataProto, cfg: RolloutConfig) -> tuple[DataProto, SamplingConfig, int]:
    """A seeded call's prompt rows (n times each when its sampling asks for n samples), its
    sampling and its seed: the engines' own rules (engines/rollout/base.py, `start_call`)."""
    check_prompts(rows)
    sampling, n = select_sampling(cfg, rows.meta_info)
    prompts, _ = without_row_index(rows)  # the whole call: row i is the call's row i
    return (prompts.repeat(n, interleave=True) if n > 1 else prompts), sampling, rows.meta_info["seed"]
