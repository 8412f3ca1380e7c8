"""envpool pieces without the actor: chat context, admission gate, environments, registry."""

import anyio
import pytest

from millstream.envpool.chat import ChatFormat
from millstream.envpool.envs import make_env, parse_answer
from millstream.envpool.envs.checks.evenchars import even_share
from millstream.envpool.gate import AdmissionGate
from millstream.shared.wire import PolicyVersion, admit_limit, group_id, group_number


@pytest.fixture(scope="module")
def chat(tiny_model_dir):
    return ChatFormat.from_model_dir(tiny_model_dir)


def test_multi_turn_context_appends_tokens_like_the_template(chat):
    response = chat.encode("hello there") + [chat.eos_id]
    ids = chat.first_prompt("be brief", "first question")
    ids += response + chat.close_turn(response) + chat.next_prompt("second question")
    rendered = chat.render(
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "hello there"},
            {"role": "user", "content": "second question"},
        ],
        add_generation_prompt=True,
    )
    assert ids == chat.encode(rendered)


def test_length_cut_response_gets_its_end_token(chat):
    cut = chat.encode("no end")
    assert chat.close_turn(cut)[0] == chat.eos_id
    ended = cut + [chat.eos_id]
    assert chat.eos_id not in chat.close_turn(ended)


def test_generated_tokens_are_never_retokenized(chat):
    # A non-canonical split of a word: decode/encode would merge it, the context must keep it.
    pieces = [chat.tokenizer.token_to_id(c) for c in "he"]
    assert None not in pieces and chat.encode("he") != pieces
    ids = chat.first_prompt("", "q") + pieces
    before = list(ids)
    ids += chat.close_turn(pieces) + chat.next_prompt("again")
    assert ids[: len(before)] == before


def test_stop_tokens_include_end_of_turn(chat):
    assert chat.eos_id in chat.stop_token_ids
    assert chat.decode(chat.encode("plain text") + [chat.eos_id]) == "plain text"


async def _admit_all(gate, limit=50):
    got = []
    with anyio.move_on_after(0.05):
        while len(got) < limit:
            n = await gate.admit(5, 5)
            if n is None:
                break
            got.append(n)
    return got


def limit(v, k=1, b=4, dropped=0, slack=0, base=0, carried=0):
    return admit_limit(
        group_base=base,
        consumed=v * b + dropped,
        carried=carried,
        groups_per_batch=b,
        max_staleness=k,
        slack=slack,
    )


def test_admit_limit_is_the_areal_rule():
    assert limit(0) == 8 and limit(1) == 12 and limit(3, k=0) == 16  # (v + k + 1) * B
    assert limit(1, dropped=2) == 14  # each dropped group frees a slot
    assert limit(0, slack=2, k=0) == 12
    assert limit(0, base=100, carried=3) == 105  # resumed: numbering continues, carried hold slots


@pytest.mark.anyio
async def test_gate_follows_the_announced_limit():
    gate = AdmissionGate()
    assert await _admit_all(gate) == []  # no version yet: nothing starts
    gate.update(PolicyVersion(0, limit(0)))
    assert await _admit_all(gate) == list(range(8))
    gate.update(PolicyVersion(1, limit(1)))
    assert await _admit_all(gate) == list(range(8, 12))
    gate.update(PolicyVersion(1, limit(1, dropped=2)))
    assert await _admit_all(gate) == [12, 13]
    gate.update(PolicyVersion(1, limit(0)))  # a late, lower heartbeat never shrinks the limit
    assert await _admit_all(gate) == []
    gate.update(PolicyVersion(1, limit(1, dropped=2), final=True))
    assert await gate.admit(1, 1) is None


@pytest.mark.anyio
async def test_gate_splits_group_numbers_between_workers_from_the_base():
    gates = [AdmissionGate(worker_index=i, workers=3) for i in range(3)]
    for gate in gates:
        gate.update(PolicyVersion(2, admit_limit=106, group_base=100))
    admitted = [await _admit_all(g) for g in gates]
    assert admitted == [[100, 103], [101, 104], [102, 105]]


@pytest.mark.anyio
async def test_gate_times_out_on_a_silent_learner():
    gate = AdmissionGate()
    gate.update(PolicyVersion(0, 1))
    assert await _admit_all(gate) == [0]
    with pytest.raises(TimeoutError, match="no policy version from the learner for 0.05s"):
        await gate.admit(60, 0.05)  # after the first version, silence is timed by the second


@pytest.mark.anyio
async def test_gate_waits_for_the_first_version_by_the_start_timeout():
    gate = AdmissionGate()
    with pytest.raises(TimeoutError, match="no first policy version from the learner for 0.05s"):
        await gate.admit(0.05, 60)


@pytest.mark.anyio
async def test_bandit_rules():
    env = make_env("bandit")
    payouts = set()
    for seed in range(40):
        obs = await env.reset(seed)
        assert "phoenix" in obs.text and "dragon" in obs.text
        low = await env.step("<think>safe</think><answer>phoenix</answer>")
        assert (low.reward, low.done, low.info["valid"]) == (0.1, True, True)
        await env.reset(seed)
        high = await env.step("<answer>Dragon</answer>")
        payouts.add(high.reward)
        await env.reset(seed)
        again = await env.step("<answer>dragon</answer>")
        assert again.reward == high.reward  # deterministic under the seed
        await env.reset(seed)
        bad = await env.step("I pick dragon")
        assert bad.info["valid"] is False and bad.reward == -0.1
    assert payouts == {0.0, 1.0}
    swapped = make_env("bandit", {"swap_names": True})
    await swapped.reset(0)
    assert (await swapped.step("<answer>dragon</answer>")).reward == 0.1


@pytest.mark.anyio
async def test_evenchars_rules():
    env = make_env("evenchars", {"turns": 2})
    obs = await env.reset(3)
    first = await env.step("bdf")  # all even code points
    assert (first.reward, first.done, first.observation.anchor) == (0.5, False, "turn1")
    second = await env.step("ace")  # all odd
    assert (second.reward, second.done) == (0.0, True)
    assert obs.anchor == "turn0"
    assert even_share("") == 0.0 and even_share("bd ac") == pytest.approx(3 / 5)


def test_registry_errors_are_clear():
    with pytest.raises(KeyError, match="unknown environment 'nope'.*known: .*bandit"):
        make_env("nope")
    with pytest.raises(TypeError, match="rejected envpool.env_args"):
        make_env("bandit", {"arms": 3})


def test_parse_answer():
    assert parse_answer("<think>x</think><answer> up || left </answer>") == ["up", "left"]
    assert parse_answer("no tags") is None
    assert parse_answer("<answer> </answer>") is None


@pytest.mark.slow
@pytest.mark.anyio
async def test_flaky_env_injects_both_faults():
    from millstream.envpool.envs.checks.flaky import InjectedFault

    crashes = hangs = clean = 0
    for i in range(200):
        env = make_env("flaky", {"crash_prob": 0.3, "hang_prob": 0.3, "hang_s": 5, "fault_seed": 1})
        try:
            with anyio.fail_after(0.05):
                await env.reset(i)
            clean += 1
        except InjectedFault:
            crashes += 1
        except TimeoutError:
            hangs += 1
    assert crashes > 30 and hangs > 30 and clean > 30


def test_group_ids_round_trip():
    assert group_number(group_id(1234)) == 1234
    with pytest.raises(ValueError, match="not a group id"):
        group_number("x12")
