"""The agent endpoint against `vllm serve`: the same greedy requests to both, field by field.

`vllm serve` (vLLM's own OpenAI server, from the venv) runs the tiny model; the endpoint runs on
the session's vLLM actor, holding the same weights (pushed back first: runs of this session may
have trained it) and sampling greedily (`envpool.temperature = 0`). Status codes, finish
reasons, stop reasons, texts, token ids, usage and logprobs agree. Where they cannot, the test
says why instead of comparing:

- a field outside what the endpoint honours: vLLM ignores it with a warning (200), the endpoint
  refuses it (400), by design (envpool/agents/requests.py);
- error messages: the endpoint's name the field and the config key; the status codes agree.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import anyio
import openai
import pytest
import torch
from helpers import keys_for
from transformers import AutoModelForCausalLM

from millstream.bench.kit.spawn import spawn, stop
from millstream.envpool.actors.client import ActorClient
from millstream.envpool.agents.endpoint import Endpoint
from millstream.envpool.chat import ChatFormat
from millstream.envpool.record import EpisodeSpec
from millstream.learner.sync.weights import WeightSender
from millstream.shared.config import EnvPoolConfig, LearnerConfig, TransportConfig
from millstream.shared.wire.transport import open_channel

pytestmark = pytest.mark.real

USER = [{"role": "user", "content": "Tell me about rivers."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_serve(actor, tmp_path_factory):
    """`vllm serve` on the session's model, with the actor's engine settings; yields its /v1 URL."""
    port = _free_port()
    log = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", actor.model_dir,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "1024",
        "--kv-cache-memory-bytes", str(128 << 20), "--no-enable-chunked-prefill",
        "--max-num-batched-tokens", "8192", "--seed", "0", "--max-logprobs", "20", "--enforce-eager",
    ]  # fmt: skip
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_LOGGING_LEVEL="WARNING")
    with log.open("wb") as out:
        proc = spawn(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"vllm serve did not start:\n{log.read_text()[-3000:]}")
                time.sleep(1)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop(proc, grace_s=60)  # the API server and its EngineCore, all of its group


def _restore_weights(actor) -> None:
    """The runs of this session trained the session's actor: give it the model's own weights."""
    model = AutoModelForCausalLM.from_pretrained(actor.model_dir, dtype=torch.float32)
    sender = WeightSender(
        actor.address, LearnerConfig(sync_timeout_s=60), dtype="float32", keys=keys_for("learner")
    )
    try:
        sender.attach()
        sender.push(model.named_parameters(), version=0)
    finally:
        sender.close()


async def _both(actor, vllm_url: str, script):
    """`script(client)` against the endpoint (one episode on the session's actor) and against
    `vllm serve`; returns (endpoint's outcome, vLLM's outcome)."""
    cfg = EnvPoolConfig(temperature=0.0, max_tokens=64, max_turns=64)
    channel = open_channel(
        "dealer", actor.address, bind=False, cfg=TransportConfig(), keys=keys_for("envpool")
    )
    client = ActorClient(channel, "differential")
    endpoint = Endpoint(ChatFormat.from_model_dir(actor.model_dir), client, cfg, lambda: 1024)
    spec = EpisodeSpec("diff-e0", "diff", seed=1, member=0, group_size=1, env_name="differential")
    async with anyio.create_task_group() as tg:
        tg.start_soon(channel.run)
        tg.start_soon(client.run)
        await tg.start(endpoint.serve)
        with endpoint.episode(spec) as (base_url, key, _):
            async with openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120) as ours:
                mine = await _outcome(script, ours)
        async with openai.AsyncOpenAI(
            base_url=vllm_url, api_key="none", max_retries=0, timeout=120
        ) as theirs:
            reference = await _outcome(script, theirs)
        tg.cancel_scope.cancel()
    return mine, reference


async def _outcome(script, client):
    try:
        return await script(client)
    except openai.APIStatusError as exc:
        return ("error", exc.status_code)


async def _chat(c, **kw):
    """A greedy chat call, naming the model the server lists (each names its own)."""
    name = (await c.models.list()).data[0].id
    return await c.chat.completions.create(model=name, messages=kw.pop("messages", USER), temperature=0, **kw)


def test_greedy_requests_agree_with_vllm_serve_field_by_field(actor, vllm_serve):
    _restore_weights(actor)

    async def script(c):
        name = (await c.models.list()).data[0].id
        out: dict = {}

        async def each(key, call, shape):
            try:
                out[key] = shape(await call())
            except openai.APIStatusError as exc:
                out[key] = ("error", exc.status_code)  # the messages differ: the endpoint's name fields

        await each("plain", lambda: _chat(c, max_tokens=16, extra_body={"return_token_ids": True}), _fields)
        text = out["plain"].get("content") or "" if isinstance(out["plain"], dict) else ""
        out["stop"] = stop = text[4:6] if len(text) >= 6 and text[4:6].strip() else None
        if stop:
            await each("stopped", lambda: _chat(c, max_tokens=16, stop=[stop]), _fields)
        await each("logprobs", lambda: _chat(c, max_tokens=6, logprobs=True, top_logprobs=2), _logprobs)
        await each(
            "n", lambda: _chat(c, max_tokens=8, n=2), lambda r: [ch.message.content for ch in r.choices]
        )
        await each("seeded", lambda: _chat(c, max_tokens=8, seed=7), lambda r: r.choices[0].message.content)
        await each(
            "completion",
            lambda: c.completions.create(
                model=name, prompt="Rivers are", max_tokens=8, temperature=0, echo=True
            ),
            lambda r: (r.choices[0].text, r.choices[0].finish_reason, r.usage.model_dump(exclude_none=True)),
        )
        await each(
            "completion_logprobs",
            lambda: c.completions.create(
                model=name, prompt="Rivers are", max_tokens=8, temperature=0, logprobs=1
            ),
            lambda r: r.choices[0].logprobs.token_logprobs,
        )
        await each("max_tokens_0", lambda: _chat(c, max_tokens=0), lambda r: "ok")
        return out

    ours, vllm = anyio.run(_both, actor, vllm_serve, script, backend="trio")
    for key in ("plain", "stop", "stopped", "n", "seeded", "completion"):
        assert ours.get(key) == vllm.get(key), (key, ours.get(key), vllm.get(key))
    assert ours["max_tokens_0"] == vllm["max_tokens_0"] == ("error", 400)
    assert ours["n"] == ("error", 400)  # greedy: n must be 1, in both
    assert ours["completion_logprobs"] == pytest.approx(vllm["completion_logprobs"], abs=1e-3)
    for (tok, lp, top), (vtok, vlp, vtop) in zip(ours["logprobs"], vllm["logprobs"], strict=True):
        assert tok == vtok and lp == pytest.approx(vlp, abs=1e-3), (ours["logprobs"], vllm["logprobs"])
        assert [t for t, _ in top] == [t for t, _ in vtop]
        assert [v for _, v in top] == pytest.approx([v for _, v in vtop], abs=1e-3)


def _logprobs(resp) -> list:
    return [
        (t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs])
        for t in resp.choices[0].logprobs.content
    ]


def _fields(resp) -> dict:
    choice = resp.choices[0]
    return {
        "token_ids": (choice.model_extra or {}).get("token_ids"),
        "prompt_token_ids": (resp.model_extra or {}).get("prompt_token_ids"),
        "content": choice.message.content,
        "finish_reason": choice.finish_reason,
        "stop_reason": (choice.model_extra or {}).get("stop_reason"),
        "usage": resp.usage.model_dump(
            exclude_none=True, include={"prompt_tokens", "completion_tokens", "total_tokens"}
        ),
    }


def test_unknown_fields_differ_by_design_and_developer_is_system_in_both(actor, vllm_serve):
    async def script(c):
        unknown = await _outcome(lambda cc: _chat(cc, max_tokens=4, extra_body={"max_token": 4}), c)
        dev = await _chat(
            c,
            max_tokens=4,
            messages=[{"role": "developer", "content": "Be brief."}, *USER],
            extra_body={"return_token_ids": True},
        )
        return {
            "unknown": unknown if isinstance(unknown, tuple) else ("ok", 200),
            "developer_prompt": dev.model_extra["prompt_token_ids"],
        }

    ours, vllm = anyio.run(_both, actor, vllm_serve, script, backend="trio")
    assert ours["unknown"] == ("error", 400) and vllm["unknown"] == ("ok", 200)  # vLLM ignores it
    # Role `developer` is `system` in both (vLLM maps it too): the same prompt, token for token.
    assert ours["developer_prompt"] == vllm["developer_prompt"]
    text = ChatFormat.from_model_dir(actor.model_dir).tokenizer.decode(
        ours["developer_prompt"], skip_special_tokens=False
    )
    assert "<|im_start|>system\nBe brief." in text
