"""One envpool worker, 2,000 concurrent episodes, injected crashes, hangs and garbage: nothing is lost.

The worker runs in-process (its real `run_worker`) against the synthetic actor process. The test
itself stands in for the learner's two sockets: it announces a `PolicyVersion` whose admission
limit lets every group start at once, and collects what the worker pushes. That stand-in only
counts messages; the accounting under test is the worker's.
"""

import time

import anyio
import pytest
from helpers import StandInLearner

from millstream.envpool.envs import Observation, StepResult
from millstream.envpool.envs.base import REGISTRY
from millstream.envpool.worker import run_worker
from millstream.shared.config import load_config
from millstream.shared.wire import Trajectory

GROUPS, GROUP_SIZE = 250, 8


class AnyReply:
    """Two turns; any reply is valid except one with a NUL (what `flaky`'s garbage contains)."""

    system_prompt = ""

    async def reset(self, seed):
        self.turn = 0
        return Observation("Say anything.", anchor="turn0")

    async def step(self, action):
        self.turn += 1
        valid = "\x00" not in action
        return StepResult(
            Observation("Again.", anchor=f"turn{self.turn}"),
            0.5 if valid else -0.1,
            self.turn >= 2,
            {"valid": valid, "success": valid},
        )  # 2,000 episodes, all admitted at once


@pytest.fixture
def anyreply():
    """Registered for this test only (other tests enumerate the registry)."""
    REGISTRY["anyreply"] = AnyReply
    yield "anyreply"
    del REGISTRY["anyreply"]


@pytest.mark.parametrize("backend", ["trio"])
@pytest.mark.slow
def test_two_thousand_concurrent_episodes_with_faults_are_all_accounted(
    synthetic, tiny_model_dir, anyreply, backend
):
    learner = StandInLearner()
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            f"actor.connect={synthetic}",
            *learner.config(),
            f"train.group_size={GROUP_SIZE}",
            "envpool.max_concurrent_episodes=2000",
            "envpool.env=flaky",
            'envpool.env_args={inner="anyreply", crash_prob=0.05, hang_prob=0.03, '
            "garbage_prob=0.1, hang_s=600}",
            "envpool.step_timeout_s=3",
            "envpool.max_tokens=16",
            "envpool.max_consecutive_actor_failures=100000",
        ],
    )
    total = GROUPS * GROUP_SIZE
    peak_live = 0

    async def learner_stand_in(stats_box):
        nonlocal peak_live
        deadline = time.monotonic() + 240
        while not learner.done and time.monotonic() < deadline:
            learner.announce(0, GROUPS, final=learner.episodes >= total)
            learner.drain()
            if stats_box:
                peak_live = max(peak_live, stats_box[0].live)
            await anyio.sleep(0.05)

    async def main():
        box = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(learner_stand_in, box)
            stats = await run_worker(cfg, 0, None, stats_hook=box.append)
            tg.cancel_scope.cancel()
        return stats

    try:
        stats = anyio.run(main, backend=backend)
        learner.drain(wait_ms=2000)  # the worker flushed PoolDone before returning; collect it
    finally:
        learner.close()
    outcomes, done = learner.outcomes, learner.done
    trajectories = [m for m in learner.received if isinstance(m, Trajectory)]
    assert done, "no PoolDone: the worker did not finish"
    assert peak_live >= 1500  # they really ran concurrently
    assert stats.started == done[0].episodes_started == total
    assert sum(outcomes.values()) == total  # every episode reported exactly once
    assert outcomes["env_error"] > 0 and outcomes["env_timeout"] > 0
    assert outcomes["trajectory"] == done[0].episodes_finished == stats.finished
    assert done[0].episodes_failed == total - outcomes["trajectory"]
    # Garbage replies are not failures: the environment answered them with its format penalty,
    # the episode went on, and the trajectories count them: about garbage_prob of all turns.
    share = sum(t.invalid_actions for t in trajectories) / sum(t.num_turns for t in trajectories)
    assert 0.06 < share < 0.14, share
    # The worker kept serving through the faults: groups admitted last completed too.
    assert {f"g{n}" for n in range(GROUPS - 10, GROUPS)} & {t.group_id for t in trajectories}
