"""SmolLM2-135M-Instruct's real chat template and tokenizer (the model `make real-model` makes)
give the same ids through millstream as through transformers' `apply_chat_template`.

Its template writes a default system prompt when the conversation has none ("You are a helpful
AI assistant named SmolLM, trained by Hugging Face"): an episode without a system prompt and an
agent that sends none must both get it, as transformers renders it. Checked on the two paths that
build contexts: an episode's turn-by-turn append path (tests/test_chat_templates.py's generated
conversations) and the per-episode OpenAI endpoint (the prompt ids the actor is sent).
"""

from __future__ import annotations

import anyio
import openai
import pytest
from hypothesis import given
from test_chat_templates import SETTINGS, conversations, hf_ids, play_turn_by_turn
from test_openai_endpoint import ScriptedClient, _play

from millstream.envpool.chat import ChatFormat
from millstream.envpool.envs.agents.agent import AgentResult
from millstream.shared.config import EnvPoolConfig

pytestmark = pytest.mark.real  # the real model's directory (smollm2_dir)

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from transformers import AutoTokenizer

    return ChatFormat.from_model_dir(smollm2_dir), AutoTokenizer.from_pretrained(smollm2_dir)


def test_an_episode_without_a_system_prompt_gets_the_default_one(smollm2):
    chat, tok = smollm2
    ids = chat.first_prompt("", "What is 2+3?")
    assert ids == hf_ids(tok, [{"role": "user", "content": "What is 2+3?"}])
    assert DEFAULT_SYSTEM in chat.decode(ids)
    assert DEFAULT_SYSTEM not in chat.decode(chat.first_prompt("Be brief.", "What is 2+3?"))
    assert chat.tokenizer.id_to_token(chat.eos_id) == "<|im_end|>"


def test_episode_contexts_equal_transformers_at_every_turn(smollm2):
    chat, tok = smollm2

    @SETTINGS
    @given(conversations("smollm2"))
    def check(conv):
        messages, tools, cut = conv
        contexts = play_turn_by_turn(chat, tok, messages, tools, cut)
        ends = range(2 if messages[0]["role"] == "system" else 1, len(messages) + 1, 2)
        for context, end in zip(contexts, ends, strict=True):
            assert context == hf_ids(tok, messages[:end], tools)
        assert chat.apply(messages, add_generation_prompt=False) == hf_ids(tok, messages, None, False)

    check()


class TwoCalls:
    """An agent that sends no system prompt, then sends the model's reply back with a question."""

    def __init__(self):
        self.sent: list[list[dict]] = []

    async def run(self, seed, base_url, api_key):
        client_args = {"base_url": base_url, "api_key": api_key, "max_retries": 0, "timeout": 30}
        async with openai.AsyncOpenAI(**client_args) as client:
            messages = [{"role": "user", "content": "What is 12+30?"}]
            self.sent.append(list(messages))
            first = await client.chat.completions.create(model="m", messages=messages)
            messages += [
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And 42-2?"},
            ]
            self.sent.append(list(messages))
            await client.chat.completions.create(model="m", messages=messages)
        return AgentResult(1.0)


def test_the_endpoint_sends_the_actor_what_transformers_renders(smollm2):
    chat, tok = smollm2
    reply = chat.encode("12+30 = 42.") + [chat.eos_id]
    agent, client = TwoCalls(), ScriptedClient([reply, reply])
    anyio.run(_play, chat, client, agent, EnvPoolConfig(), backend="trio")
    assert len(client.prompts) == 2
    for prompt, messages in zip(client.prompts, agent.sent, strict=True):
        assert prompt == hf_ids(tok, messages)
        assert DEFAULT_SYSTEM in chat.decode(prompt)
