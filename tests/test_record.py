"""The episode record keeps replies packed (logprobs as doubles, versions as one int when one
policy made a whole reply) and lays them out per token only when the episode ends: the layout
must be what plain per-token lists would give, whatever the replies. And it hands requests its
own context, which the client encodes as it queues them."""

from functools import partial

import anyio
import msgspec
from hypothesis import given
from hypothesis import strategies as st

from millstream.envpool.actors.client import ActorClient
from millstream.envpool.actors.generation import Generation, Sampling
from millstream.envpool.record import EpisodeRecord, EpisodeSpec
from millstream.shared.wire import Abort, Codec, GenerateRequest

ids = st.lists(st.integers(0, 200_000), max_size=12)
version_runs = st.lists(st.integers(0, 3), min_size=1, max_size=3)


@st.composite
def replies(draw):
    """A reply, its logprobs and versions usually one per token; a broken generation's lists
    may be shorter or longer (the record cuts them to the reply and leaves the rest unset)."""
    tokens = draw(ids)
    n = len(tokens)
    lengths = st.sampled_from([n, n, n, max(n - 1, 0), n + 1, 0])
    versions = sorted(draw(version_runs))  # a reply may span a weight update: versions rise
    v_len = draw(lengths)
    per_token = [versions[min(i * len(versions) // max(v_len, 1), len(versions) - 1)] for i in range(v_len)]
    logprobs = [-float(draw(st.integers(0, 50))) / 7 for _ in range(draw(lengths))]
    return Generation(tokens, logprobs, per_token, "stop"), draw(st.booleans())


def reference(turns):
    """The layout written out token by token, from the prompts and replies as given: a list
    cut to its reply, what it lacks left as a prompt token's value."""
    out_ids, mask, logprobs, versions = [], [], [], []
    for prompt, (gen, trained) in turns:
        out_ids += prompt
        mask += [0] * len(prompt)
        logprobs += [0.0] * len(prompt)
        versions += [-1] * len(prompt)
        n = len(gen.token_ids)
        out_ids += gen.token_ids
        mask += [int(trained)] * n
        logprobs += gen.logprobs[:n] + [0.0] * (n - len(gen.logprobs[:n]))
        versions += gen.versions[:n] + [-1] * (n - len(gen.versions[:n]))
    return out_ids, mask, logprobs, versions


@given(st.lists(st.tuples(ids, replies()), min_size=1, max_size=5))
def test_packed_replies_lay_out_as_per_token_lists(turns):
    record = EpisodeRecord(EpisodeSpec("e0", "g0", 1, 0, 1, "test"))
    for prompt, (gen, trained) in turns:
        record.add_prompt(prompt)
        record.add_reply(gen, trained=trained)
        assert record.last_reply() == gen.token_ids
    want_ids, *want_lists = reference(turns)
    assert record.ids == want_ids
    assert list(record.token_lists()) == want_lists
    assert record.visible() is record.ids  # the first segment is shared, never copied


def test_a_later_segment_is_a_copy_from_its_start():
    record = EpisodeRecord(EpisodeSpec("e0", "g0", 1, 0, 1, "test"))
    record.add_prompt([5, 6, 7])
    record.start_segment()
    record.add_prompt([8, 9])
    assert record.visible() == [8, 9] and record.visible() is not record.ids


class QueueOnly:
    """Stands in for the client's channel: keeps what is queued, sends nothing."""

    def __init__(self):
        self.queued = []

    async def send(self, message, timeout=60.0):
        self.queued.append(message)

    def send_nowait(self, message):
        self.queued.append(message)


def test_a_request_is_encoded_as_it_is_queued_so_the_record_may_grow():
    """The client hands the channel bytes, not a message holding the episode's own list: a
    request still queued when its turn ended (a timeout) must not go out with a later prompt."""
    channel = QueueOnly()
    client = ActorClient(channel, "w0")
    prompt = [5, 6, 7]

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(client.generate_once, prompt, Sampling(max_tokens=4), seed=1))
            await anyio.wait_all_tasks_blocked()
            prompt.extend([8, 9])  # the record grows after the turn
            tg.cancel_scope.cancel()

    anyio.run(main, backend="trio")
    request, abort = channel.queued
    assert isinstance(request, msgspec.Raw)
    sent = Codec().decode_one(request)
    assert isinstance(sent, GenerateRequest) and sent.prompt_token_ids == [5, 6, 7]
    assert isinstance(abort, Abort)  # the cancelled turn told the actor to stop
