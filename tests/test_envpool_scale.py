"""One envpool worker, 2,000 concurrent episodes, injected crashes, hangs and garbage: nothing is lost.

The worker runs in-process (its real `run_worker`) against the synthetic actor process. The test
itself stands in for the learner's two sockets: it announces a `PolicyVersion` whose admission
limit lets every group start at once, and collects what the worker pushes. That stand-in only
counts messages; the accounting under test is the worker's.
"""

import time
from collections import Counter

import anyio
import pytest

from millstream.envpool.envs import Observation, StepResult
from millstream.envpool.envs.base import REGISTRY
from millstream.envpool.worker import run_worker
from millstream.shared.config import load_config
from millstream.shared.protocol import Codec, EpisodeFailed, PolicyVersion, PoolDone, Trajectory

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
        return StepResult(Observation("Again.", anchor=f"turn{self.turn}"), 0.5 if valid else -0.1,
                          self.turn >= 2, {"valid": valid, "success": valid})  # 2,000 episodes, all admitted at once


@pytest.fixture
def anyreply():
    """Registered for this test only (other tests enumerate the registry)."""
    REGISTRY["anyreply"] = AnyReply
    yield "anyreply"
    del REGISTRY["anyreply"]


@pytest.mark.parametrize("backend", ["trio"])
def test_two_thousand_concurrent_episodes_with_faults_are_all_accounted(synthetic, tiny_model_dir,
                                                                         anyreply, backend):
    import zmq

    ctx = zmq.Context.instance()
    pull, pub = ctx.socket(zmq.PULL), ctx.socket(zmq.PUB)
    exp_port = pull.bind_to_random_port("tcp://127.0.0.1")
    ver_port = pub.bind_to_random_port("tcp://127.0.0.1")
    cfg = load_config(None, [
        f"model.path={tiny_model_dir}", f"actor.connect={synthetic}",
        f"learner.experience_address=tcp://127.0.0.1:{exp_port}",
        f"learner.version_address=tcp://127.0.0.1:{ver_port}",
        f"train.group_size={GROUP_SIZE}", "envpool.max_concurrent_episodes=2000",
        "envpool.env=flaky",
        'envpool.env_args={inner="anyreply", crash_prob=0.05, hang_prob=0.03, garbage_prob=0.1, hang_s=600}',
        "envpool.step_timeout_s=3", "envpool.max_tokens=16", "envpool.max_consecutive_actor_failures=100000",
    ])
    codec = Codec()
    outcomes: Counter = Counter()
    nonlocal_counts: Counter = Counter()
    trained_groups: set[str] = set()
    done: list[PoolDone] = []
    peak_live = 0
    total = GROUPS * GROUP_SIZE

    def drain(wait_ms: int = 0) -> None:
        while pull.poll(wait_ms):
            for m in codec.decode(pull.recv()):
                if isinstance(m, Trajectory):
                    outcomes["trajectory"] += 1
                    trained_groups.add(m.group_id)
                    nonlocal_counts["invalid"] += m.invalid_actions
                    nonlocal_counts["turns"] += m.num_turns
                elif isinstance(m, EpisodeFailed):
                    outcomes[m.cause] += 1
                elif isinstance(m, PoolDone):
                    done.append(m)

    async def learner_stand_in(stats_box):
        nonlocal peak_live
        final_sent = False
        deadline = time.monotonic() + 240
        while not done and time.monotonic() < deadline:
            pub.send(codec.encode([PolicyVersion(0, GROUPS, 0, final=final_sent)]))
            drain()
            if stats_box:
                peak_live = max(peak_live, stats_box[0].live)
            final_sent = final_sent or sum(outcomes.values()) >= total
            await anyio.sleep(0.05)

    async def main():
        box = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(learner_stand_in, box)
            stats = await run_worker(cfg, 0, None, stats_hook=box.append)
            tg.cancel_scope.cancel()
        return stats

    stats = anyio.run(main, backend=backend)
    drain(wait_ms=2000)  # the worker flushed PoolDone before returning; collect it
    pull.close(0)
    pub.close(0)
    assert done, "no PoolDone: the worker did not finish"
    assert peak_live >= 1500  # they really ran concurrently
    assert stats.started == done[0].episodes_started == total
    assert sum(outcomes.values()) == total  # every episode reported exactly once
    assert outcomes["env_error"] > 0 and outcomes["env_timeout"] > 0
    assert outcomes["trajectory"] == done[0].episodes_finished == stats.finished
    assert done[0].episodes_failed == total - outcomes["trajectory"]
    # Garbage replies are not failures: the environment answered them with its format penalty,
    # the episode went on, and the trajectories count them: about garbage_prob of all turns.
    share = nonlocal_counts["invalid"] / nonlocal_counts["turns"]
    assert 0.06 < share < 0.14, share
    # The worker kept serving through the faults: groups admitted last completed too.
    assert {f"g{n}" for n in range(GROUPS - 10, GROUPS)} & trained_groups
