"""Agent loops on a rollout pool (trainer.placement=disaggregated, rollout.agent.loop: tool or
openai): the loops (or the recipe's OpenAI-client agents, with their endpoint) run on the driver,
and each turn is one request that the router (router.py) sends to a replica, a rollout process whose
engine serves requests as they come (`generate_request`, engines/rollout/request_batches.py):

    generate(rows):                               a training or validation call
        every row's trajectory is a session "<call's seed>-<row>", the rows' loops run concurrently
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
from collections.abc import Callable
from pathlib import Path

import torch

from engines.rollout.base import REPLICA_KEY
from engines.rollout.config import SamplingConfig
from engines.rollout.requests import Completion
from hybridflow.agents.loop import session_name
from hybridflow.protocol import DataProto
from hybridflow.single_controller.errors import CallDeadline, call_timeout, worker_error
from hybridflow.trainer.policy import Policy
from hybridflow.trainer.prompts import PromptBatches, StepPrompts
from hybridflow.trainer.rollout.pool import PoolRollout, count_lines, keep_first_lines, oldest_versions
from hybridflow.trainer.rollout.router import Router
from hybridflow.utils.imports import first_line
from hybridflow.utils.tracking import move_aside

ROUTES_FILE = "router.jsonl"
ROUTES_LINES_FILE = "router_lines.json"  # in the rollout's checkpoint part


class RoutedAgentRollout:
    def __init__(self, pool: PoolRollout, make_agents: Callable, output_dir: str, deadline: CallDeadline):
        """`make_agents(request)`: what generates a call's rows (`generate_sequences`), its requests
        sampled by `request(session, ids, sampling, seed, max_new_tokens)`: here, routed."""
        self.pool = pool
        self.agents = make_agents(self.route_request)
        self.router = Router(pool.group.world_size)
        self.sessions: dict[str, Session] = {}  # the call's, by name
        self.request_deadline = deadline  # of one request
        self.routes_file = Path(output_dir) / ROUTES_FILE
        self.routes_begun = False  # a fresh start's router.jsonl moved aside
        self.lost_errors: list[BaseException] = []  # of the replicas lost in the call under way
        self.kills: list[asyncio.Future] = []  # of the call's hung replicas, each in a thread
        self.moved = 0  # turns routed off a lost replica since the last step's metrics

    def sync_weights(self, policy: Policy) -> None:
        self.pool.sync_weights(policy)

    def responses(self, prompts: PromptBatches, steps_left: int) -> tuple[StepPrompts, DataProto]:
        step = prompts.next()
        return step, self.generate(step.rows)

    def generate(self, rows: DataProto) -> DataProto:
        """Every row's trajectory, its turns routed over the pool's replicas."""
        seeded = self.pool.seeded(rows)
        self.sessions, self.kills = {}, []
        batch = self.agents.generate_sequences(seeded)
        self.restart_lost()
        self.record(self.router.take_routes())
        names = [session_name(seeded.meta_info["seed"], row) for row in range(len(batch))]
        replicas = [self.sessions[name].replica if name in self.sessions else -1 for name in names]
        batch.batch["policy_version"] = oldest_versions(batch.batch["rollout_versions"])  # (B,)
        batch.batch[REPLICA_KEY] = torch.tensor(replicas, dtype=torch.long)  # (B,)
        return batch

    async def route_request(
        self, session: str, ids: list[int], sampling: SamplingConfig, seed: int, max_new_tokens: int
    ) -> Completion:
        """One request of the session's trajectory, on the replica the router picks."""
        routed = self.sessions.setdefault(session, Session(self, session))
        return await routed.generate(ids, sampling, seed, max_new_tokens)

    async def request(
        self, replica: int, ids: list[int], sampling: SamplingConfig, seed: int, max_new_tokens: int
    ) -> Completion | None:
        """The replica's answer to one request; None when the replica was lost meanwhile (its
        process died, or it passed the request deadline and was killed as hung). An error the
        request raised there is a WorkerError naming the replica."""
        import ray.exceptions

        group = self.pool.group
        call = group.call_rank_async(replica, "generate_request", ids, sampling, seed, max_new_tokens)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(call.future()), self.request_deadline.seconds)
        except ray.exceptions.RayActorError as err:
            self.lose(replica, err)
        except ray.exceptions.RayTaskError as err:  # the engine's own error: the run stops, naming it
            raise worker_error(err, replica, "generate_request") from err
        except TimeoutError:
            hung = call_timeout("rollout replica", replica, "generate_request", self.request_deadline)
            self.lose(replica, hung)
            await self.kill(replica)
        return None

    async def kill(self, replica: int) -> None:
        """The hung replica's process killed in a thread: the kill waits for Ray to report the
        process dead, and the other sessions' turns go on meanwhile."""
        kill = asyncio.ensure_future(asyncio.to_thread(self.pool.group.kill_rank, replica))
        self.kills.append(kill)
        await kill

    async def restart_every_lost(self) -> None:
        """With no live replica left: once the kills under way are done (a replica still being killed
        would count as alive), the lost replicas restarted."""
        await asyncio.gather(*self.kills)
        self.restart_lost()

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

    def __init__(self, owner: RoutedAgentRollout, name: str):
        self.owner, self.name = owner, name
        self.turns = 0
        self.replica = -1  # the replica that served the last turn

    async def generate(self, ids: list[int], sampling: SamplingConfig, seed: int, max_new: int) -> Completion:
        turn, self.turns = self.turns, self.turns + 1
        router, tokens = self.owner.router, len(ids) + max_new
        while True:
            if not router.live:  # every replica lost: restarted now, the loops waiting
                await self.owner.restart_every_lost()
            replica = router.route(self.name, turn, tokens)
            try:
                completion = await self.owner.request(replica, ids, sampling, seed, max_new)
            finally:
                router.finished(replica, tokens)
            if completion is not None:
                self.replica = replica
                return completion
