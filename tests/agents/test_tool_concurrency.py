"""Tool calls in agent loops are bounded and keep the event loop free: at most
`rollout.agent.max_concurrent_tool_calls` calls run at once over every trajectory of a call (the
rest wait their turn, outside their timeout), and the Python sandbox starts, reaps and cleans up
its processes off the event loop that steps the engine."""

import asyncio
import os
import shutil
import subprocess
import threading
from typing import Any, ClassVar

import pytest

from engines.rollout.config import AgentConfig
from hybridflow.agents.rollout import tool_runner
from hybridflow.agents.tools import PythonSandbox
from hybridflow.agents.tools import python_sandbox as sandbox_module

CALL = '<tool_call>\n{"name": "hold", "arguments": {}}\n</tool_call>'
DEADLINE_S = 60.0


class Hold:
    """A tool whose calls record how many run at once and wait until `release` is set."""

    name = "hold"
    description = "Waits."
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}

    def __init__(self):
        self.inside, self.most, self.release = 0, 0, asyncio.Event()

    async def call(self, arguments: dict[str, Any]) -> str:
        self.inside += 1
        self.most = max(self.most, self.inside)
        try:
            await self.release.wait()
        finally:
            self.inside -= 1
        return "done"


async def wait_for(condition, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + DEADLINE_S
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"waited {DEADLINE_S:g} s for {what}")
        await asyncio.sleep(0)


def test_concurrent_tool_calls_over_all_rows_stay_within_the_setting():
    agent = AgentConfig(loop="tool", tools=["tests.hold"], max_concurrent_tool_calls=3, tool_timeout_s=5)

    async def main():
        hold = Hold()
        run_tools = tool_runner([hold], agent)
        rows = [asyncio.ensure_future(run_tools(CALL * 2)) for _ in range(6)]  # 12 calls at once
        await wait_for(lambda: hold.inside == 3, "3 calls to be running")
        for _ in range(100):  # the others had every chance to start
            await asyncio.sleep(0)
        assert hold.inside == 3
        hold.release.set()
        results = await asyncio.gather(*rows)
        return hold.most, results

    most, results = asyncio.run(main())
    assert most == 3
    assert [r.responses for r in results] == [["done", "done"]] * 6 and sum(r.errors for r in results) == 0


def test_the_default_bound_is_the_machines_cores():
    assert AgentConfig().max_concurrent_tool_calls == 0
    assert AgentConfig().tool_call_limit() == os.cpu_count()
    with pytest.raises(ValueError, match=r"rollout.agent.max_concurrent_tool_calls must be >= 0 \(0: "):
        AgentConfig(max_concurrent_tool_calls=-1)


def test_the_bound_without_the_tool_loop_is_named_as_unread():
    from hybridflow.checks.agents import _agent_settings_unread
    from hybridflow.config.schema import RecipeConfig

    cfg = RecipeConfig()
    cfg.rollout.agent = AgentConfig(max_concurrent_tool_calls=4)
    assert _agent_settings_unread(cfg) == [
        "rollout.agent.max_concurrent_tool_calls=4 has no effect with rollout.agent.loop=single_turn: "
        "only loop=tool reads it; set rollout.agent.loop=tool, or remove it"
    ]


def test_the_sandbox_starts_reaps_and_cleans_up_off_the_event_loop(monkeypatch):
    """Popen, wait and the directory's removal each wait inside until the event loop has run
    another coroutine: done on the loop's own thread, they would wait for nothing and be named."""
    beat, blocked = threading.Event(), []

    def gate(name: str) -> None:
        beat.clear()
        if not beat.wait(timeout=10):
            blocked.append(name)

    class GatedPopen(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            gate("Popen")
            super().__init__(*args, **kwargs)

        def wait(self, timeout=None):
            gate("wait")
            return super().wait(timeout)

    rmtree = shutil.rmtree

    def gated_rmtree(*args, **kwargs):
        gate("rmtree")
        return rmtree(*args, **kwargs)

    sandbox = PythonSandbox(layers=["seccomp", "audit"])
    monkeypatch.setattr(sandbox_module.subprocess, "Popen", GatedPopen)
    monkeypatch.setattr(shutil, "rmtree", gated_rmtree)

    async def main():
        async def heartbeat():
            while True:
                beat.set()
                await asyncio.sleep(0.001)

        beating = asyncio.ensure_future(heartbeat())
        try:
            return await sandbox.call({"code": "print(6 * 7)"})
        finally:
            beating.cancel()

    assert asyncio.run(main()) == "42\n"
    assert blocked == [], f"{blocked} ran on the event loop's thread and stalled it"
