"""One episode: token-in/token-out bookkeeping and failure causes against the real actor, and
the turns an observation shapes (untrained turns, fresh contexts, invalid actions) against the
synthetic actor or a scripted client."""

import gc
import itertools

import anyio
import pytest
from helpers import Recorder, keys_for

from millstream.envpool.actors.client import ActorClient, Generation
from millstream.envpool.chat import ChatFormat
from millstream.envpool.envs import Observation, StepResult, make_env
from millstream.envpool.episode import EpisodeSpec, run_episode
from millstream.shared.config import EnvPoolConfig, TransportConfig
from millstream.shared.wire import Cause, EpisodeFailed, Trajectory, Truncation
from millstream.shared.wire.transport import open_channel


def play(actor, env, **cfg):
    chat = ChatFormat.from_model_dir(actor.model_dir)
    spec = EpisodeSpec("e0", "g0", seed=11, member=0, group_size=1, env_name="test")

    async def main():
        channel = open_channel(
            "dealer", actor.address, bind=False, cfg=TransportConfig(), keys=keys_for("envpool")
        )
        client = ActorClient(channel, "episode-test")
        async with anyio.create_task_group() as tg:
            tg.start_soon(channel.run)
            tg.start_soon(client.run)
            result = await run_episode(spec, env, chat, client, EnvPoolConfig(**cfg), 1024)
            tg.cancel_scope.cancel()
        return result

    return anyio.run(main, backend="trio"), chat


def test_multi_turn_trajectory_is_consistent(actor):
    traj, chat = play(actor, make_env("evenchars", {"turns": 3}), max_tokens=8)
    assert isinstance(traj, Trajectory) and traj.num_turns == 3
    n = len(traj.token_ids)
    assert len(traj.loss_mask) == len(traj.logprobs) == len(traj.versions) == n
    generated = {i for s, e in zip(traj.turn_starts, traj.turn_ends) for i in range(s, e)}
    assert generated == {i for i, m in enumerate(traj.loss_mask) if m}
    assert all(traj.versions[i] >= 0 and traj.logprobs[i] <= 0 for i in generated)
    assert all(traj.versions[i] == -1 and traj.logprobs[i] == 0 for i in range(n) if i not in generated)
    assert traj.anchors == ["turn0", "turn1", "turn2"]
    # Each turn names the request that made it (the trajectory store finds a call by it).
    assert len(set(traj.request_ids)) == 3 and all(r.startswith("episode-test-") for r in traj.request_ids)
    assert traj.reward == pytest.approx(sum(traj.turn_rewards))
    # Each turn's reward is computed from exactly the tokens the model generated in that turn.
    for (s, e), r in zip(zip(traj.turn_starts, traj.turn_ends), traj.turn_rewards):
        text = chat.decode(traj.token_ids[s:e])
        share = sum(1 for c in text if ord(c) % 2 == 0) / len(text) if text else 0.0
        assert r == pytest.approx(share / 3)
    # The context starts with the rendered first prompt, untouched.
    assert traj.token_ids[: traj.turn_starts[0]] == chat.first_prompt("", "Write anything.")


class Broken:
    system_prompt = ""

    def __init__(self, where, how):
        self.where, self.how = where, how

    async def _fault(self, where):
        if where == self.where:
            if self.how == "raise":
                raise ValueError("boom")
            await anyio.sleep(60)

    async def reset(self, seed):
        await self._fault("reset")
        return Observation("go", "s0")

    async def step(self, action):
        await self._fault("step")
        return StepResult(Observation("", "s1"), 1.0, True, {})


@pytest.mark.parametrize("where", ["reset", "step"])
@pytest.mark.parametrize("how, cause", [("raise", "env_error"), ("hang", "env_timeout")])
def test_environment_faults_end_the_episode_with_a_cause(actor, where, how, cause):
    result, _ = play(actor, Broken(where, how), step_timeout_s=0.5, max_tokens=4)
    assert isinstance(result, EpisodeFailed)
    assert result.cause == cause and result.episode_id == "e0"
    assert where in result.message
    # The scene of the failure: nothing before the first prompt; after it, the turn so far.
    if where == "reset":
        assert result.scene is None
    else:
        scene = result.scene
        assert scene is not None and scene.request is None  # the generation itself went fine
        assert scene.texts[0] == "go" and len(scene.turn_starts) == len(scene.request_ids) == 1
        reply = scene.token_ids[scene.turn_starts[0] : scene.turn_ends[0]]
        assert reply and scene.texts[1] == ChatFormat.from_model_dir(actor.model_dir).decode(reply)


def test_a_turn_that_times_out_leaves_what_had_arrived_in_the_scene(actor):
    """A generation cut by its timeout: the failed episode's scene names the request, holds the
    tokens streamed before the cut (with their logprobs and versions) and the error."""
    env = make_env("evenchars", {"turns": 3})
    # Seeded, so every turn's length is fixed; the timeout must cut one whatever the engine's
    # speed. At 0.4 s a quiet machine once played all three turns (the longest of at least 333
    # tokens: the episode filled its 1,024-token context) in time; 0.05 s would need 6,600
    # tokens/s from one sequence.
    result, _ = play(actor, env, max_tokens=1000, turn_timeout_s=0.05, actor_retries=0)
    assert isinstance(result, EpisodeFailed) and result.cause is Cause.ACTOR_TIMEOUT
    assert result.scene is not None and result.scene.request is not None
    request = result.scene.request
    assert request.request_id.startswith("episode-test-") and "0.05s" in request.error
    assert len(request.token_ids) == len(request.logprobs) == len(request.versions) < 1000
    assert request.turn == len(result.scene.turn_starts)


def test_context_budget_truncates_instead_of_failing(actor):
    env = make_env("evenchars", {"turns": 50})
    traj, _ = play(actor, env, max_tokens=400, max_turns=50)
    assert isinstance(traj, Trajectory) and traj.truncated == Truncation.CONTEXT_FULL
    assert len(traj.token_ids) <= 1024 and traj.num_turns < 50


def test_first_prompt_longer_than_context_is_a_named_failure(actor):
    env = make_env("evenchars", {"prompt": "word " * 1500})
    result, _ = play(actor, env)
    assert isinstance(result, EpisodeFailed) and result.cause is Cause.PROMPT_TOO_LONG


# --- observation-shaped turns: untrained turns, fresh contexts (Delethink), invalid actions ----
#
# `Scripted` plays observations from a list; `ScriptedClient` answers with fixed generations
# (exact token ids, for exact checks of the carried ids); `Recorder` wraps the production client
# against the synthetic actor and remembers each request's prompt and each generation.

STOP = 2  # <|im_end|> of the tiny model (the chat format's eos), a stop token


class Scripted:
    """reset -> `first`; step k -> `steps[k]` = (observation, reward, done, info)."""

    def __init__(self, first, steps, system_prompt=""):
        self.first, self.steps, self.system_prompt = first, steps, system_prompt
        self.actions = []

    async def reset(self, seed):
        self.actions = []
        return self.first

    async def step(self, action):
        self.actions.append(action)
        obs, reward, done, info = self.steps[len(self.actions) - 1]
        return StepResult(obs, reward, done, info)


class ScriptedClient:
    """Returns `replies[k]` (token ids) for the k-th request, cut to max_tokens, and records."""

    def __init__(self, replies):
        self.replies, self.prompts, self.generations = replies, [], []

    async def generate(self, prompt_token_ids, sampling, **_):
        ids = self.replies[len(self.prompts)][: sampling.max_tokens]
        self.prompts.append(list(prompt_token_ids))
        gen = Generation(
            list(ids),
            [-0.5] * len(ids),
            [3] * len(ids),
            "stop" if ids and ids[-1] in sampling.stop_token_ids else "length",
        )
        self.generations.append(gen)
        return gen


def play_scripted(model_dir, env, replies, max_model_len=1024, **cfg):
    chat = ChatFormat.from_model_dir(model_dir)
    client = ScriptedClient(replies)
    spec = EpisodeSpec("e0", "g0", seed=11, member=0, group_size=1, env_name="test")
    result = anyio.run(
        run_episode, spec, env, chat, client, EnvPoolConfig(**cfg), max_model_len, backend="trio"
    )
    return result, chat, client


def play_recorded(address, model_dir, env, seed=11, **cfg):
    chat = ChatFormat.from_model_dir(model_dir)
    spec = EpisodeSpec("e0", "g0", seed=seed, member=0, group_size=1, env_name="test")
    box = {}

    async def main():
        channel = open_channel("dealer", address, bind=False, cfg=TransportConfig(), keys=keys_for("envpool"))
        client = Recorder(ActorClient(channel, "episode-test"))
        box["client"] = client
        async with anyio.create_task_group() as tg:
            tg.start_soon(channel.run)
            tg.start_soon(client.client.run)
            result = await run_episode(spec, env, chat, client, EnvPoolConfig(**cfg), 1024)
            tg.cancel_scope.cancel()
        return result

    return anyio.run(main, backend="trio"), chat, box["client"]


def ranges(traj):
    return list(zip(traj.turn_starts, traj.turn_ends))


@pytest.mark.parametrize("trained", [(True, False, True), (False, True, False)])
def test_untrained_turn_is_generated_but_masked(synthetic, tiny_model_dir, trained):
    # The observation each turn answers carries its `trained`; the last step ends the episode.
    first = Observation("one", "a0", trained=trained[0])
    steps = [
        (Observation("two", "a1", trained=trained[1]), 0.0, False, {}),
        (Observation("three", "a2", trained=trained[2]), 0.0, False, {}),
        (Observation("", "end"), 1.0, True, {}),
    ]
    traj, _, client = play_recorded(
        synthetic, tiny_model_dir, Scripted(first, steps), max_tokens=8, max_turns=4
    )
    assert isinstance(traj, Trajectory) and traj.num_turns == 3
    assert traj.anchors == ["a0", "a1", "a2"] and traj.turn_rewards == [0.0, 0.0, 1.0]
    for (s, e), gen, flag in zip(ranges(traj), client.generations, trained):
        assert e - s == len(gen.token_ids) >= 1
        assert traj.loss_mask[s:e] == [int(flag)] * (e - s)
        # Trained or not, the behaviour logprobs and versions of the tokens are kept.
        assert traj.logprobs[s:e] == gen.logprobs and all(lp < 0 for lp in gen.logprobs)
        assert traj.versions[s:e] == gen.versions and all(v >= 0 for v in gen.versions)
    assert sum(traj.loss_mask) == sum(e - s for (s, e), f in zip(ranges(traj), trained) if f)
    # An untrained turn is still part of the one chat context the next turns see.
    assert traj.segment_starts == []
    for t in range(3):
        assert client.prompts[t] == traj.token_ids[: traj.turn_starts[t]]


def test_fresh_contexts_open_with_the_prompt_and_the_carried_ids(tiny_model_dir):
    g0 = [101, 102, 103, 104, 105, 106, STOP]  # ends on the stop token (removed from a carry)
    g1 = [201, 202, STOP]  # shorter than the next carry: the carry reaches into the last one
    g2 = list(range(301, 311))  # cut by max_tokens=8
    first = Observation("Query.", "c0")
    steps = [
        (Observation("Query. Go on (2).", "c1", new_context=True, carry_tokens=4), 0.0, False, {}),
        (Observation("Query. Go on (3).", "c2", new_context=True, carry_tokens=5), 0.0, False, {}),
        (Observation("", "done"), 1.0, True, {}),
    ]
    env = Scripted(first, steps, system_prompt="Think in chunks.")
    traj, chat, client = play_scripted(tiny_model_dir, env, [g0, g1, g2], max_tokens=8, max_turns=5)
    assert isinstance(traj, Trajectory) and traj.num_turns == 3
    p0 = chat.first_prompt("Think in chunks.", "Query.")
    p1 = chat.first_prompt("Think in chunks.", "Query. Go on (2).")
    p2 = chat.first_prompt("Think in chunks.", "Query. Go on (3).")
    carry1 = [103, 104, 105, 106]  # the last 4 generated ids, the stop token removed
    carry2 = [104, 105, 106, 201, 202]  # the last 5 of (carried + generated), stop removed
    g2c = g2[:8]
    expected = p0 + g0 + p1 + carry1 + g1 + p2 + carry2 + g2c
    assert traj.token_ids == expected
    s1, s2 = len(p0 + g0), len(p0 + g0 + p1 + carry1 + g1)
    assert traj.segment_starts == [s1, s2]
    assert ranges(traj) == [
        (len(p0), s1),
        (s1 + len(p1 + carry1), s2),
        (s2 + len(p2 + carry2), len(expected)),
    ]
    # Each request saw its own context only: the fresh prompt and the carry, nothing before.
    assert client.prompts == [p0, p1 + carry1, p2 + carry2]
    # Only generated ids carry loss; the carried ids are context (trained where generated).
    assert (
        traj.loss_mask
        == [0] * len(p0) + [1] * 7 + [0] * len(p1 + carry1) + [1] * 3 + [0] * len(p2 + carry2) + [1] * 8
    )
    assert [traj.versions[i] for i in range(len(expected)) if traj.loss_mask[i]] == [3] * 18
    assert [traj.logprobs[i] for i in range(len(expected)) if not traj.loss_mask[i]] == [0.0] * (
        len(expected) - 18
    )
    # The environment saw each reply without the carry: the model's own continuation.
    assert env.actions == [chat.decode(g0), chat.decode(g1), chat.decode(g2c)]


@pytest.mark.parametrize("carry_tokens", [0, 1, 50])
def test_carry_length_zero_one_and_more_than_generated(tiny_model_dir, carry_tokens):
    g0, g1 = [111, 112, 113, STOP], [121, STOP]
    first = Observation("Ask.", "s0")
    steps = [
        (Observation("Ask again.", "s1", new_context=True, carry_tokens=carry_tokens), 0.0, False, {}),
        (Observation("", "done"), 0.0, True, {}),
    ]
    traj, chat, client = play_scripted(tiny_model_dir, Scripted(first, steps), [g0, g1], max_tokens=8)
    carry = {0: [], 1: [113], 50: [111, 112, 113]}[carry_tokens]
    fresh = chat.first_prompt("", "Ask again.")
    assert traj.segment_starts == [len(chat.first_prompt("", "Ask.")) + len(g0)]
    assert client.prompts[1] == fresh + carry
    assert traj.token_ids[traj.segment_starts[0] :] == fresh + carry + g1


def test_fresh_context_without_room_truncates(tiny_model_dir):
    chat = ChatFormat.from_model_dir(tiny_model_dir)
    first = Observation("Hi.", "s0")
    long_text = "word " * 200
    steps = [
        (Observation(long_text, "s1", new_context=True, carry_tokens=2), 0.0, False, {}),
        (Observation("", "done"), 0.0, True, {}),
    ]
    room = len(chat.first_prompt("", "Hi.")) + 20
    assert len(chat.first_prompt("", long_text)) > room  # the fresh context cannot fit
    traj, _, client = play_scripted(
        tiny_model_dir, Scripted(first, steps), [[131, 132, 133], [141]], max_model_len=room, max_tokens=8
    )
    assert isinstance(traj, Trajectory) and traj.num_turns == 1 and len(client.prompts) == 1
    assert traj.segment_starts == [] and len(traj.token_ids) == traj.turn_ends[0]


def test_every_turn_gets_its_whole_budget_or_the_episode_ends_truncated(tiny_model_dir):
    """A turn's budget is never cut below max_tokens: when the next prompt plus max_tokens would
    not fit, the episode ends there, trained, and says why."""
    chat = ChatFormat.from_model_dir(tiny_model_dir)
    steps = [(Observation(f"Again {k}.", f"s{k + 1}"), 0.1, False, {}) for k in range(10)]
    first = len(chat.first_prompt("", "Hi."))
    room = first + 8 + 30  # the first turn fits; a few more do, then the context is full
    traj, _, client = play_scripted(
        tiny_model_dir,
        Scripted(Observation("Hi.", "s0"), steps),
        [[131, 132, 133, 134, 135, 136, 137, STOP]] * 10,
        max_model_len=room,
        max_tokens=8,
        max_turns=10,
    )
    assert isinstance(traj, Trajectory) and traj.truncated == Truncation.CONTEXT_FULL
    assert 1 < traj.num_turns < 10 and len(client.prompts) == traj.num_turns
    assert all(len(p) + 8 <= room for p in client.prompts)  # every request had its 8 tokens


def test_max_turns_and_done_are_told_apart(tiny_model_dir):
    steps = [(Observation("More.", "s1"), 0.5, False, {}), (Observation("", "s2"), 1.0, True, {})]
    cut, _, _ = play_scripted(
        tiny_model_dir,
        Scripted(Observation("Hi.", "s0"), steps),
        [[131, STOP], [132, STOP]],
        max_tokens=4,
        max_turns=1,
    )
    assert cut.truncated == Truncation.MAX_TURNS and cut.num_turns == 1
    whole, _, _ = play_scripted(
        tiny_model_dir,
        Scripted(Observation("Hi.", "s0"), steps),
        [[131, STOP], [132, STOP]],
        max_tokens=4,
        max_turns=2,
    )
    assert whole.truncated is None and whole.num_turns == 2


@pytest.mark.parametrize("reward", [float("nan"), float("inf")])
def test_a_reward_that_is_not_a_number_fails_the_episode(tiny_model_dir, reward):
    """A NaN or infinite reward is the environment's failure, counted as env_error: the learner
    refused it in training, but evaluation took it into its means (a NaN reward_mean)."""
    steps = [(Observation("", "s1"), reward, True, {})]
    failed, _, _ = play_scripted(
        tiny_model_dir, Scripted(Observation("Hi.", "s0"), steps), [[131, STOP]], max_tokens=4
    )
    assert isinstance(failed, EpisodeFailed) and failed.cause == Cause.ENV_ERROR
    assert f"returned the reward {reward}" in failed.message


def test_a_first_prompt_without_room_for_max_tokens_fails_before_any_request(tiny_model_dir):
    chat = ChatFormat.from_model_dir(tiny_model_dir)
    room = len(chat.first_prompt("", "Hi.")) + 7  # one token short of max_tokens
    result, _, client = play_scripted(
        tiny_model_dir, Scripted(Observation("Hi.", "s0"), []), [], max_model_len=room, max_tokens=8
    )
    assert isinstance(result, EpisodeFailed) and result.cause is Cause.PROMPT_TOO_LONG
    assert "with max_tokens 8 that exceeds max_model_len" in result.message
    assert client.prompts == []


def test_fresh_contexts_against_the_synthetic_actor(synthetic, tiny_model_dir):
    first = Observation("Query.", "c0")
    steps = [
        (Observation("Query, chunk 2.", "c1", new_context=True, carry_tokens=6), 0.0, False, {}),
        (Observation("Query, chunk 3.", "c2", new_context=True, carry_tokens=10), 0.0, False, {}),
        (Observation("", "done"), 0.0, True, {}),
    ]
    traj, chat, client = play_recorded(
        synthetic, tiny_model_dir, Scripted(first, steps, "Sys."), max_tokens=8, max_turns=3
    )
    assert isinstance(traj, Trajectory) and traj.num_turns == 3
    gens = [g.token_ids for g in client.generations]
    stop = set(chat.stop_token_ids)
    carry1 = [i for i in gens[0] if i not in stop][-6:]
    carry2 = [i for i in carry1 + gens[1] if i not in stop][-10:]
    p1, p2 = chat.first_prompt("Sys.", "Query, chunk 2."), chat.first_prompt("Sys.", "Query, chunk 3.")
    assert client.prompts == [chat.first_prompt("Sys.", "Query."), p1 + carry1, p2 + carry2]
    s1, s2 = traj.segment_starts
    assert (s1, s2) == (traj.turn_ends[0], traj.turn_ends[1])
    assert traj.token_ids[s1:s2] == p1 + carry1 + gens[1]
    assert traj.token_ids[s2:] == p2 + carry2 + gens[2]
    assert traj.loss_mask[s1] == traj.loss_mask[s2] == 0
    assert [i for i, m in enumerate(traj.loss_mask) if m] == [i for s, e in ranges(traj) for i in range(s, e)]


def test_invalid_actions_are_counted(synthetic, tiny_model_dir):
    first = Observation("go", "t0")
    steps = [
        (Observation("again", "t1"), -0.1, False, {"valid": False}),
        (Observation("again", "t2"), 0.0, False, {}),  # no "valid": counts as valid
        (Observation("again", "t3"), 0.5, False, {"valid": True}),
        (Observation("", "t4"), -0.1, True, {"valid": False, "success": False}),
    ]
    traj, _, _ = play_recorded(synthetic, tiny_model_dir, Scripted(first, steps), max_tokens=4, max_turns=4)
    assert isinstance(traj, Trajectory) and traj.num_turns == 4
    assert traj.invalid_actions == 2
    assert traj.success is False  # the last turn's info["success"] reaches the learner
    assert traj.turn_rewards == [-0.1, 0.0, 0.5, -0.1] and traj.reward == pytest.approx(0.3)


@pytest.mark.parametrize("fresh", [False, True], ids=["bridge", "new_context"])
def test_nothing_follows_the_last_reply(tiny_model_dir, fresh):
    first = Observation("Go.", "s0")
    more = Observation("More.", "s1", new_context=fresh, carry_tokens=2 if fresh else 0)
    steps = [(more, 0.0, False, {}), (more, 0.0, False, {}), (more, 0.0, False, {})]
    traj, _, _ = play_scripted(
        tiny_model_dir, Scripted(first, steps), [[151, 152]] * 3, max_tokens=4, max_turns=2
    )
    assert isinstance(traj, Trajectory) and traj.num_turns == 2
    # The trajectory is the context the model saw: it ends with its last reply, and every
    # segment holds a generated turn.
    assert len(traj.token_ids) == traj.turn_ends[-1]
    bounds = [*traj.segment_starts, len(traj.token_ids)]
    assert all(any(a < t < b for t in traj.turn_starts) for a, b in zip(bounds, bounds[1:]))


def test_infinite_limits_mean_no_limit(synthetic, tiny_model_dir):
    """A limit set to inf (step, turn, episode) is no deadline at all, as before the wheel."""
    inf = float("inf")
    env = make_env("evenchars", {"turns": 2})
    traj, _, _ = play_recorded(
        synthetic,
        tiny_model_dir,
        env,
        max_tokens=8,
        step_timeout_s=inf,
        turn_timeout_s=inf,
        episode_timeout_s=inf,
    )
    assert isinstance(traj, Trajectory) and traj.num_turns == 2


class KeptResults(Scripted):
    """`Scripted`, keeping every step result it returned (for `HoldCheckingClient`)."""

    def __init__(self, first, steps):
        super().__init__(first, steps)
        self.results = []

    async def step(self, action):
        result = await super().step(action)
        self.results.append(result)
        return result


class HoldCheckingClient(ScriptedClient):
    """A scripted client that, asked for a reply, first lets `watch` look (from another task,
    while the episode is suspended in its wait, as 10,000 live episodes are) at what still
    refers to the episode's earlier generations and step results, besides the test's lists."""

    def __init__(self, replies, env):
        super().__init__(replies)
        self.env, self.holders, self.prompts_seen, self.looks = env, [], [], 0
        self.to_watch, self.asks = anyio.create_memory_object_stream[anyio.Event](4)

    async def generate(self, prompt_token_ids, sampling, **kw):
        self.prompts_seen.append(prompt_token_ids)
        if self.generations:
            looked = anyio.Event()
            self.to_watch.send_nowait(looked)
            with anyio.fail_after(10):
                await looked.wait()
        return await super().generate(prompt_token_ids, sampling, **kw)

    async def watch(self):
        # Plain loops: a comprehension naming `held` would make it a closure cell, a referrer.
        async for looked in self.asks:
            self.looks += 1
            ours = (self.generations, self.env.results)
            for held in itertools.chain(*ours):  # (a list of them would refer to them too)
                for referrer in gc.get_referrers(held):
                    if referrer is not ours[0] and referrer is not ours[1]:
                        self.holders.append(f"{type(held).__name__} held by a {type(referrer).__name__}")
            looked.set()


def test_a_waiting_episode_holds_no_earlier_generation_and_no_copy_of_its_context(tiny_model_dir):
    steps = [(Observation(f"More {k}.", f"s{k}"), 0.5, k == 2, {"valid": True}) for k in range(3)]
    env = KeptResults(Observation("Hi.", "s0"), steps)
    chat = ChatFormat.from_model_dir(tiny_model_dir)
    client = HoldCheckingClient([[131, 132, STOP], [133, STOP], [134, STOP]], env)
    spec = EpisodeSpec("e0", "g0", seed=11, member=0, group_size=1, env_name="test")

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.watch)
            traj = await run_episode(spec, env, chat, client, EnvPoolConfig(max_tokens=4), 1024)
            tg.cancel_scope.cancel()
        return traj

    traj = anyio.run(main, backend="trio")
    assert isinstance(traj, Trajectory) and traj.num_turns == 3
    assert client.looks == 2
    # Before: the episode's coroutine held the last `Generation` and the last `StepResult`.
    assert client.holders == []
    # Every request was handed the record's own context, not a copy per turn.
    assert all(prompt is traj.token_ids for prompt in client.prompts_seen)
    assert traj.logprobs[traj.turn_starts[1]] == -0.5 and traj.versions[traj.turn_starts[1]] == 3
