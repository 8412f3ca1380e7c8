"""One sequence per episode (envpool/agents/splice.py): an assistant message the endpoint produced,
sent back by the agent, becomes the tokens it was sampled as, so a five-call tool-using agent
trains as one sequence; a template that rewrites history, or an agent that edits a reply, still
starts a new segment. Driven by the official client against exact scripted token ids, on the
test families' ChatML-with-tools and thinking templates (tests/templates)."""

import anyio
import openai
import pytest
from test_chat_templates import WEATHER, write_model_dir
from test_openai_endpoint import STOP, ScriptedClient, _play, assert_recorded_as_sampled

from millstream.envpool.chat import ChatFormat
from millstream.envpool.envs.agents.agent import AgentResult
from millstream.shared.config import EnvPoolConfig
from millstream.shared.wire import Trajectory

#: A call as models often write it: compact JSON, which the template writes back with spaces.
CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'


class ToolLoop:
    """Calls the model `calls` times, sending back each reply (as the client got it, or edited)
    with a tool result, as agent frameworks do."""

    def __init__(self, calls: int, edit: bool = False):
        self.calls, self.edit = calls, edit
        self.replies: list[dict] = []

    async def run(self, seed, base_url, api_key):
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30) as c:
            messages = [{"role": "user", "content": "Weather in Paris, five times."}]
            for k in range(self.calls):
                out = await c.chat.completions.create(model="m", messages=messages, tools=[WEATHER])
                reply = out.choices[0].message.model_dump(exclude_none=True)
                self.replies.append(reply)
                if self.edit:
                    reply = {**reply, "content": (reply.get("content") or "") + " (edited)"}
                messages.append(reply)
                for call in reply.get("tool_calls", []):
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"sunny {k}"})
                if not reply.get("tool_calls"):
                    messages.append({"role": "user", "content": "Again."})
        return AgentResult(1.0)


def play(model_dir, agent, replies, **cfg):
    chat = ChatFormat.from_model_dir(model_dir)
    client = ScriptedClient(replies)
    config = EnvPoolConfig(**{"max_tokens": 200, "max_turns": 8, **cfg})
    traj = anyio.run(_play, chat, client, agent, config, 16384, backend="trio")
    assert isinstance(traj, Trajectory), traj
    return traj, client, chat


@pytest.fixture(scope="module")
def family_dirs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("splice")
    return {f: write_model_dir(tiny_model_dir, root / f, f) for f in ("chatml_tools", "thinking")}


def tool_replies(chat, n):
    return [chat.encode(CALL) + [STOP]] * (n - 1) + [chat.encode("Sunny all week.") + [STOP]]


def test_a_five_call_tool_agent_trains_as_one_sequence(family_dirs):
    chat = ChatFormat.from_model_dir(family_dirs["chatml_tools"])
    traj, client, _ = play(family_dirs["chatml_tools"], ToolLoop(5), tool_replies(chat, 5))
    assert traj.num_turns == 5 and traj.segment_starts == []
    for k in range(1, 5):  # each prompt extends the last one by exactly the sampled reply
        before = client.prompts[k - 1] + client.generations[k - 1].token_ids
        assert client.prompts[k][: len(before)] == before
    # The spliced context reads as the template renders the conversation: the same text.
    whole = client.prompts[4] + client.generations[4].token_ids
    assert chat.tokenizer.decode(client.prompts[4], skip_special_tokens=False).endswith(
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert_recorded_as_sampled(traj, client)
    assert len(traj.token_ids) == len(whole)

    unspliced, fresh, _ = play(
        family_dirs["chatml_tools"], ToolLoop(5), tool_replies(chat, 5), agent_splice_replies=False
    )
    # Rendered afresh, the template writes each call back in its own spelling (the arguments
    # through tojson), which is not what the model sampled: every call is its own segment, and
    # the shared prefix is trained again in each.
    assert len(unspliced.segment_starts) == 4
    assert len(unspliced.token_ids) > 2 * len(traj.token_ids)
    assert_recorded_as_sampled(unspliced, fresh)


def test_an_edited_reply_starts_a_new_segment(family_dirs):
    chat = ChatFormat.from_model_dir(family_dirs["chatml_tools"])
    plain = [chat.encode("Cloudy.") + [STOP]] * 3
    traj, client, _ = play(family_dirs["chatml_tools"], ToolLoop(3, edit=True), plain)
    assert len(traj.segment_starts) == 2  # the agent's text is not what was sampled: rendered afresh
    assert_recorded_as_sampled(traj, client)
    kept, client2, _ = play(family_dirs["chatml_tools"], ToolLoop(3), plain)
    assert kept.segment_starts == []
    assert_recorded_as_sampled(kept, client2)


def test_a_template_that_rewrites_history_starts_a_new_segment(family_dirs):
    chat = ChatFormat.from_model_dir(family_dirs["thinking"])
    assert chat.rerenders is not None
    thought = [chat.encode("<think>hmm</think>Cloudy.") + [STOP]] * 3
    traj, client, _ = play(family_dirs["thinking"], ToolLoop(3), thought)
    # The template drops the earlier <think>: a render up to the reply is not a prefix of the
    # whole render, so each call is rendered afresh, as the model will see it in deployment.
    assert len(traj.segment_starts) == 2
    assert_recorded_as_sampled(traj, client)


@pytest.mark.parametrize("family", ["qwen2.5", "smollm3", "llama3.1"])
def test_five_calls_are_one_sequence_with_a_real_template(tiny_model_dir, tmp_path, family):
    """The real templates of tests/templates/real: Qwen2.5 (ChatML, Hermes calls), SmolLM3
    (ChatML, `{% generation %}` tags), Llama 3.1 (its own JSON calls)."""
    from test_real_templates import write_family

    path = write_family(tiny_model_dir, tmp_path / family, family)
    chat = ChatFormat.from_model_dir(path)
    call = CALL if family != "llama3.1" else '{"name":"get_weather","parameters":{"city":"Paris"}}'
    replies = [chat.encode(call) + [chat.eos_id]] * 4 + [chat.encode("Sunny all week.") + [chat.eos_id]]
    traj, client, _ = play(path, ToolLoop(5), replies, max_tokens=300)
    assert traj.num_turns == 5 and traj.segment_starts == [], family
    assert_recorded_as_sampled(traj, client)
    fresh, _, _ = play(path, ToolLoop(5), replies, max_tokens=300, agent_splice_replies=False)
    assert len(fresh.segment_starts) == 4 and len(fresh.token_ids) > 2 * len(traj.token_ids)
