"""A rollout pool of its own (trainer.placement=disaggregated), as the driver sees it.

A sync transfers the policy's weights from the actor's rank 0 to every rollout engine over the
transfer group (hybridflow/workers/rollout_worker.py, engines/weight_sync/transfer.py), only when the engines
do not serve the policy's version already, or, with trainer.async_training.sync_every k, once they
serve a version k or more updates old (`sync_due`): in between they generate with weights up to
k - 1 updates older than the policy trained. Each generated sample carries the version that produced
it (`policy_version`), and each trained batch's versions are appended to
`<output_dir>/policy_versions.jsonl`:

    {"trained_on": 3, "sample_versions": [2, 2, 3, ...]}   # staleness = trained_on - version

one line per trained step, `trained_on` the policy's version at the step's sync, the one it trains
(whether or not weights moved; a restart met after the update sends the engines the newer weights
early, and changes nothing of it); a run resumed in the same directory first drops the lines the
interrupted run wrote after its checkpoint, and a fresh start moves an earlier run's file aside (to
policy_versions.jsonl.<k>), as metrics.jsonl does.

`metrics` gives `async/staleness_mean`, `async/staleness_max`, the histogram `async/staleness/<s>`
(share of samples s updates old), `async/weight_syncs` (transfers to the engines since the last
step's metrics), with what they moved (`weight_sync/bytes_sent`, `weight_sync/bytes_full`: a full
transfer's, `weight_sync/changed_share`: of the elements, 1.0 without rollout.weight_sync_delta),
`async/engine_lag` (updates the engines' weights trailed the trained policy by at
the step's sync) and, with partial rollouts (a sample's version is that of its
oldest token), `async/mixed_version_share`: the share of samples whose tokens come from more than
one version (`rollout_versions`, per token).

A rollout process that dies (killed, out of memory, a segfault in a kernel, a lost node), met by
any call (a generation, its collection, a transfer, whose sender then fails on the closed
connection: the pool is asked whether a process died before that error is believed), is restarted
(`recover`), up to `rollout.max_engine_restarts` times in a run:

    a fresh worker in the dead one's slot (RayWorkerGroup.restart_rank), its engine built
    every member leaves the broken transfer group (the sender first) and a new one is built
    the policy last synced is sent to every engine again
    the restarted engines' log-probs of fixed tokens are compared with the actor's (vLLM; the hf
        engine cannot score) within the rollout dtype's tolerance, else WeightSyncError
    the lost call is generated again from its rows, with its seed: every call carries the seed
        of its sampling position (the engines' own rule, `SamplingPosition`, made explicit), so
        a seeded engine gives the rows the lost call would have given

`metrics` adds `rollout/engine_restarts` (restarts so far in the run, counted on over a resume:
checkpoints hold the count, and the limit applies to the whole run), `rollout/restart_seconds`
(seconds spent restarting since the last step's metrics; the lost call's second generation not
included) and, after a restart, `rollout/restart_log_prob_diff` (the check's largest difference).
One death more than the limit (any, with `max_engine_restarts: 0`) ends the run with one
`RolloutProcessDied` naming the process and the call; the last complete checkpoint stays.
"""

import contextlib
import functools
import itertools
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engines.rollout.base import ROW_KEY, SamplingPosition, is_validation
from engines.rollout.config import RolloutConfig
from engines.weight_sync.common import WeightSyncError
from engines.weight_sync.delta import DeltaStats
from hybridflow.protocol import DataProto, DataProtoConfig, DataProtoFuture
from hybridflow.single_controller.errors import CallDeadline, CallTimeout, WorkerError, call_timeout
from hybridflow.trainer.policy import Policy
from hybridflow.trainer.prompts import PromptBatches, StepPrompts
from hybridflow.trainer.rollout.unread import report_unread
from hybridflow.utils.imports import first_line
from hybridflow.utils.tracking import move_aside
from hybridflow.workers.protocols import RolloutGroup, TransferPolicyGroup

VERSIONS_LINES_FILE = "policy_versions_lines.json"  # in the rollout's checkpoint part
RESTARTS_FILE = "engine_restarts.json"  # in the rollout's checkpoint part


class RolloutProcessDied(RuntimeError):
    """A rollout pool process died and no restart was left; the run stops (the last complete
    checkpoint stays)."""


def process_died(err: BaseException) -> bool:
    """Whether an error is Ray's word that a worker process died (a worker-group call's WorkerError
    or a launched call's own error), or a call's deadline passing: a hung process is killed and
    restarted as a dead one is (`kill_hung`)."""
    import ray.exceptions

    return isinstance(err, ray.exceptions.RayActorError | CallTimeout)


def died_error(err: BaseException, note: str = "", dead: list[int] | None = None) -> RolloutProcessDied:
    """One line naming the process and the call (`err`: a worker-group call's error, or Ray's own
    for a launched call, whose process is then the first of `dead`)."""
    rank = getattr(err, "rank", None)
    rank = rank if rank is not None else (dead or ["?"])[0]
    method = getattr(err, "method", None) or "a launched generation"
    cause = err.cause if isinstance(err, WorkerError) else err
    how = "hung in" if isinstance(err, CallTimeout) else "died during"
    return RolloutProcessDied(
        f"rollout pool process {rank} {how} `{method}` (trainer.rollout_pool): "
        f"{first_line(cause)}; {note}rerun the same command to resume from the last checkpoint"
    )


@contextmanager
def naming_dead_processes() -> Iterator[None]:
    """A rollout process's death, met by any call in the block, as one RolloutProcessDied."""
    try:
        yield
    except (WorkerError, CallTimeout) as err:
        if not process_died(err):
            raise
        raise died_error(err) from err


def message_line(err: WorkerError) -> str:
    """A worker call's error in one line: the call, the rank and the cause."""
    return str(err).strip().splitlines()[0]


@contextmanager
def under_deadline(group, deadline: CallDeadline) -> Iterator[None]:
    """The group's calls in the block under `deadline` (groups run in process have none)."""
    with group.deadline(deadline) if hasattr(group, "deadline") else contextlib.nullcontext():
        yield


def staleness_metrics(trained_on: int, sample_versions: list[int]) -> dict[str, float]:
    """How many updates behind the trained policy the batch's samples are: mean, max, and the
    share of samples at each staleness (a histogram, `async/staleness/<s>`)."""
    staleness = [trained_on - version for version in sample_versions]
    shares = {f"async/staleness/{s}": n / len(staleness) for s, n in sorted(Counter(staleness).items())}
    return {
        "async/staleness_mean": sum(staleness) / len(staleness),
        "async/staleness_max": float(max(staleness)),
        **shares,
    }


def sync_due(served: int | None, version: int, every: int) -> bool:
    """Whether a step's sync transfers the policy's weights (version `version`) to engines serving
    `served` (None: unknown, as after a start, a resume or a failed transfer): once they trail it by
    `every` updates (trainer.async_training.sync_every). Counted in versions, so an update the guards
    refused counts for nothing, and the engines never trail by more than every - 1 after a sync."""
    return served is None or version - served >= every


def mixed_version_share(versions: torch.Tensor) -> float:
    """Share of rows sampled by more than one policy version; `versions` (B, R) holds each response
    token's version, -1 where no token was sampled."""
    newest = versions.max(dim=1).values  # (B,)
    return (newest > oldest_versions(versions)).float().mean().item()


def oldest_versions(versions: torch.Tensor) -> torch.Tensor:
    """Each row's oldest sampled token's version (B,); `versions` (B, R), -1 where none was sampled."""
    return versions.masked_fill(versions < 0, torch.iinfo(versions.dtype).max).min(dim=1).values


def connect_transfer(policy_group: TransferPolicyGroup, rollout_group: RolloutGroup) -> None:
    """Build the transfer group: the actor's rank 0 and one member per rollout process."""
    host, port = policy_group.transfer_address()
    rollout_group.start_join_transfer(host, port, 1 + rollout_group.world_size)
    policy_group.join_transfer(host, port, 1 + rollout_group.world_size)
    rollout_group.finish_transfer()


@dataclass
class LaunchedCall:
    """A generation launched on the pool: its rows (with their seed), generated again if a rollout
    process dies before it is collected, and the workers' future."""

    rows: DataProto
    future: DataProtoFuture


@dataclass
class EngineRestarts:
    """The run's rollout process restarts: how many, against the limit, and their cost."""

    limit: int  # rollout.max_engine_restarts
    count: int = 0
    seconds: float = 0.0  # since the last step's metrics
    log_prob_diff: float | None = None  # of the last check, until the next step's metrics

    def metrics(self) -> dict[str, float]:
        out = {"rollout/engine_restarts": float(self.count), "rollout/restart_seconds": self.seconds}
        if self.log_prob_diff is not None:
            out["rollout/restart_log_prob_diff"] = self.log_prob_diff
        self.seconds, self.log_prob_diff = 0.0, None
        return out


class PoolRollout:
    def __init__(self, group: RolloutGroup, output_dir: str, rollout_cfg: RolloutConfig | None = None):
        cfg = rollout_cfg or RolloutConfig(max_engine_restarts=0)
        self.group = group  # the rollout workers
        self.versions_file = Path(output_dir) / "policy_versions.jsonl"
        self.served: int | None = None  # the version the engines serve
        self.synced: int | None = None  # the policy's version at the driver's last sync: trained on next
        self.lag = 0  # updates the engines trailed the policy by after the last sync (sync_every > 1)
        self.transfers = 0  # weight transfers to the engines since the last step's metrics
        self.versions_begun = False  # policy_versions.jsonl resumed, or a fresh start's moved aside
        self.policy: Policy | None = None  # the policy last synced: a restarted engine gets its weights
        self.restarts = EngineRestarts(cfg.max_engine_restarts)
        self.seed, self.dtype = cfg.seed, cfg.dtype
        self.transfer_deadline = CallDeadline(
            cfg.weight_transfer_timeout_s, "rollout.weight_transfer_timeout_s"
        )
        self.position = SamplingPosition()  # generation calls sent to the pool (each engine's)
        self.sent = DeltaStats()  # what the transfers since the last step's metrics moved

    def sync_weights(self, policy: Policy, every: int = 1) -> None:
        """The policy's weights to the engines when they trail it by `every` updates or more
        (trainer.async_training.sync_every; `sync_due`); the policy's version is the one trained on
        next, whether or not weights moved."""
        self.policy = policy
        if sync_due(self.served, policy.version, every):
            self._retrying(lambda: self.transfer(policy))
        self.synced, self.lag = policy.version, policy.version - self.served

    def newest_weights(self) -> None:
        """The engines serve the newest weights of the policy last synced, whatever sync_every
        (validation generates with them)."""
        if self.policy is not None:
            self._retrying(lambda: self.transfer(self.policy))

    def transfer(self, policy: Policy) -> None:
        """The policy's weights to every engine, unless they serve its version already."""
        if self.served == policy.version:
            return
        self.served = None  # a failed transfer leaves the engines serving no known version
        self.group.start_receive_weights()
        with under_deadline(policy.group, self.transfer_deadline):
            self.send(policy)
        with under_deadline(self.group, self.transfer_deadline):
            served = set(self.group.finish_transfer())
        if served != {policy.version}:
            raise RuntimeError(
                f"rollout engines serve {sorted(served)}, not the version sent ({policy.version})"
            )
        self.served = policy.version
        self.transfers += 1

    def send(self, policy: Policy) -> None:
        """The policy's side of a transfer. When it fails, the cause named is a dead receiver; else
        one WeightSyncError names the sender's error and each receiver's: the member whose own
        failure broke the transfer closed its end, and the others' errors echo it."""
        try:
            answers = policy.send_weights()
        except WorkerError as err:
            self.group.ping()  # raises for a dead rollout process
            receivers = "; ".join(self.receiver_failures()) or "every receiver finished"
            raise WeightSyncError(
                f"weight transfer to the rollout pool failed: {message_line(err)}; {receivers}"
            ) from err
        except CallTimeout as err:  # the actor's, not a rollout process to restart: the run stops
            raise RuntimeError(f"weight transfer to the rollout pool: {err}") from err
        for sent in answers or []:
            if isinstance(sent, DeltaStats):
                self.sent.merge(sent)

    def receiver_failures(self) -> list[str]:
        """Each rollout process's error in the transfer under way, one line each: every process
        asked at once, under one transfer deadline (one still receiving then is named as such)."""
        deadline = self.transfer_deadline
        calls = [self.group.call_rank_async(rank, "finish_transfer") for rank in range(self.group.world_size)]
        finished = self.group.wait_calls(calls, wait_s=deadline.seconds)
        failures = []
        for rank, call in enumerate(calls):
            if call not in finished:
                failures.append(str(call_timeout("rollout pool process", rank, "finish_transfer", deadline)))
                continue
            try:
                self.group.call_result(call, rank, "finish_transfer")
            except WorkerError as err:
                failures.append(message_line(err))
        return failures

    def responses(self, prompts: PromptBatches, steps_left: int) -> tuple[StepPrompts, DataProto]:
        step = prompts.next()
        return step, self.generate(step.rows)

    def generate(self, rows: DataProto) -> DataProto:
        seeded = self.seeded(rows)
        return self._retrying(lambda: self.group.generate_sequences(seeded))

    def launch(self, rows: DataProto) -> LaunchedCall:
        """Generation on the pool while the driver goes on (the rollout generating ahead)."""
        seeded = self.seeded(rows)
        return LaunchedCall(seeded, self.group.generate_sequences_async(seeded))

    def collect(self, launched: LaunchedCall | DataProto) -> DataProto:
        """A launched generation's responses, once finished (generated again if a process died)."""
        if isinstance(launched, DataProto):
            return launched
        return self._retrying(
            lambda: self.finished(launched), lambda: self.group.generate_sequences(launched.rows)
        )

    def finished(self, launched: LaunchedCall) -> DataProto:
        """The launched call's responses, waited for up to the rollout group's call deadline (a
        CallTimeout naming the first rank still running after it); groups run in process have none."""
        deadline = getattr(self.group, "call_deadline", None)
        if deadline is not None:
            refs = launched.future.futures  # one per rank, in rank order
            done = set(self.group.wait_calls(refs, wait_s=deadline.seconds))
            running = [ref for ref in refs if ref not in done]
            if running:
                rank = refs.index(running[0])
                raise call_timeout("rollout pool process", rank, "generate_sequences_async", deadline)
        return launched.future.get()

    def seeded(self, rows: DataProto) -> DataProto:
        """The rows (views) with this call's seed, the one the engines would pick themselves (a
        streaming rollout seeds each group call here, in submission order), and each row's index in
        the call (`ROW_KEY`): the processes seed their chunk's rows as those rows of the call."""
        seeded = rows.slice()
        seed = self.position.next_seed(self.seed, is_validation(seeded.meta_info))
        seeded.meta_info.setdefault("seed", seed)
        seeded.non_tensor_batch[ROW_KEY] = np.arange(len(seeded))
        # a call the processes do not divide (8 rows on 3) is padded with copies of its first rows,
        # their answers dropped
        seeded.meta_info[DataProtoConfig.auto_padding_key] = True
        return seeded

    def _retrying(self, call: Callable, again: Callable | None = None):
        """call(); when a rollout process dies during it, a recovery and again() (call() when not
        given), each time one dies, up to the restart limit."""
        for attempt in itertools.count():
            try:
                result = call()
            except Exception as err:
                if not process_died(err):
                    raise
                died = err
                self.kill_hung(err)
            else:
                if isinstance(result, DataProto):
                    result.meta_info.pop("seed", None)  # the call's, not the batch's
                return result
            if not self.recover(died) and attempt > 0:  # dead again, yet no process is
                raise died_error(died) from died
            call = again or call

    def recover(self, cause: BaseException | None = None) -> list[int]:
        """Restart every dead rollout process with the weights of the policy last synced (checked);
        the restarted ranks. RolloutProcessDied beyond rollout.max_engine_restarts (or before any
        sync). `cause`: the error of the call that met the death, named in that error."""
        dead = self.group.dead_ranks()
        if not dead:  # e.g. a call launched on a process restarted since
            return []
        self._check_limit(cause, dead)
        start = time.monotonic()
        with naming_dead_processes():  # one more death while restarting ends the run
            for rank in dead:
                self.group.restart_rank(rank)
                self.group.call_rank(rank, "init_model")
            self.reconnect()
            self.transfer(self.policy)
            self.restarts.log_prob_diff = self.check_engines(dead)
        self.restarts.count += len(dead)
        self.restarts.seconds += time.monotonic() - start
        print(
            f"rollout pool: restarted process(es) {dead}, {self.restarts.count} restart(s) so far", flush=True
        )
        return dead

    def kill_hung(self, err: BaseException) -> None:
        """A rollout process whose call passed its deadline (CallTimeout) killed: `recover` then
        restarts it as a dead one."""
        if isinstance(err, CallTimeout):
            print(f"rollout pool: {err}; killing it as hung", flush=True)
            self.group.kill_rank(err.rank)

    def _check_limit(self, cause: BaseException | None, dead: list[int]) -> None:
        limit, done = self.restarts.limit, self.restarts.count
        if self.policy is not None and done + len(dead) <= limit:
            return
        note = f"{done} restart(s) before, rollout.max_engine_restarts={limit}; " if limit else ""
        cause = cause or RuntimeError(f"rollout pool process(es) {dead} died")
        raise died_error(cause, note, dead) from cause

    def reconnect(self) -> None:
        """A new transfer group: the sender closes the broken one first (a survivor's receive under
        way then fails), every rollout process leaves it, and all join the new one."""
        self.served = None
        self.policy.group.leave_transfer()
        self.group.leave_transfer()
        connect_transfer(self.policy.group, self.group)

    def check_engines(self, ranks: list[int]) -> float | None:
        """The largest difference between the actor's log-probs of fixed tokens and each restarted
        engine's (None where no engine can score); WeightSyncError beyond the dtype's tolerance."""
        from engines.weight_sync.colocated import VERIFY_LOG_PROB_TOLERANCE

        ids, actor = next(answer for answer in self.policy.group.probe_log_probs() if answer is not None)
        diffs = []
        for rank in ranks:
            engine = self.group.call_rank(rank, "score_log_probs", ids)
            if engine is not None:
                diffs.append(float((actor - engine[:, -actor.shape[1] :]).abs().max()))
        tolerance = VERIFY_LOG_PROB_TOLERANCE[self.dtype]
        if diffs and not max(diffs) <= tolerance:
            raise WeightSyncError(
                f"restarted rollout process(es) {ranks}: their log-probs of fixed tokens differ from the "
                f"actor's (policy version {self.served}) by up to {max(diffs):.3g} (tolerance {tolerance})"
            )
        return max(diffs) if diffs else None

    def metrics(self, batch: DataProto) -> dict[str, float]:
        """The batch's staleness against the version trained on (the one the driver last synced,
        whatever a restart since sent), recorded in policy_versions.jsonl, the weight transfers since
        the last step's metrics and the engines' lag at the step's sync, and the engine restarts."""
        versions = batch.batch["policy_version"].tolist()
        self.record_versions({"trained_on": self.synced, "sample_versions": versions})
        metrics = staleness_metrics(self.synced, versions)
        if "rollout_versions" in batch.batch:  # partial rollouts
            metrics["async/mixed_version_share"] = mixed_version_share(batch.batch["rollout_versions"])
        metrics |= {"async/weight_syncs": float(self.transfers), "async/engine_lag": float(self.lag)}
        if self.sent.elements:
            metrics |= self.sent.metrics()
        self.transfers, self.sent = 0, DeltaStats()
        return {**metrics, **self.restarts.metrics()}

    def record_versions(self, line: dict) -> None:
        """One line of policy_versions.jsonl; a fresh start's first moves an earlier run's aside."""
        if not self.versions_begun:
            self.versions_begun = True
            move_aside(self.versions_file)
        with self.versions_file.open("a") as out:
            out.write(json.dumps(line) + "\n")

    def save(self, path: str) -> None:
        """Each engine's sampling position: the pool's count of calls (a restarted engine's too);
        how many lines policy_versions.jsonl has; the run's engine restarts so far. A process that
        dies during it is restarted (within rollout.max_engine_restarts) and every state saved again."""
        self._retrying(lambda: self.save_positions(path))
        (Path(path) / VERSIONS_LINES_FILE).write_text(json.dumps({"lines": count_lines(self.versions_file)}))
        (Path(path) / RESTARTS_FILE).write_text(json.dumps({"count": self.restarts.count}))

    def save_positions(self, path: str) -> None:
        self.group.advance_rng_state(self.position.state())
        self.group.save_rng_state(path)

    def load(self, path: str, reads: str | None = None) -> None:
        """What `save` wrote. `reads`: the file of drawn-ahead prompts the calling mode takes from
        the same directory (`unread.AHEAD_FILE` or `STREAM_FILE`); another mode's is reported."""
        states = [SamplingPosition.from_state(state) for state in self.group.load_rng_state(path)]
        self.position = functools.reduce(SamplingPosition.advanced_to, states)
        self.served = None
        self.load_run_records(Path(path))
        report_unread(path, reads)

    def load_run_records(self, path: Path) -> None:
        """policy_versions.jsonl cut to the checkpoint's lines (appended to from now on) and the
        run's count of engine restarts (checkpoints of older runs lack either)."""
        lines, restarts = path / VERSIONS_LINES_FILE, path / RESTARTS_FILE
        if lines.is_file():
            keep_first_lines(self.versions_file, json.loads(lines.read_text())["lines"])
        self.versions_begun = True
        if restarts.is_file():
            self.restarts.count = json.loads(restarts.read_text())["count"]


def count_lines(path: Path) -> int:
    return len(path.read_bytes().splitlines()) if path.is_file() else 0


def keep_first_lines(path: Path, lines: int) -> None:
    """`path` cut after its first `lines` lines (those an interrupted run wrote after them go)."""
    if path.is_file():
        os.truncate(path, sum(len(line) for line in path.read_bytes().splitlines(keepends=True)[:lines]))
