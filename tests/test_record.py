"""The episode record keeps replies packed (logprobs as doubles, versions as one int when one
policy made a whole reply) and lays them out per token only when the episode ends: the layout
must be what plain per-token lists would give, whatever the replies."""

from hypothesis import given
from hypothesis import strategies as st

from millstream.envpool.actors.generation import Generation
from millstream.envpool.record import EpisodeRecord, EpisodeSpec

ids = st.lists(st.integers(0, 200_000), max_size=12)
version_runs = st.lists(st.integers(0, 3), min_size=1, max_size=3)


@st.composite
def replies(draw):
    tokens = draw(ids)
    versions = sorted(draw(version_runs))  # a reply may span a weight update: versions rise
    per_token = [
        versions[min(i * len(versions) // max(len(tokens), 1), len(versions) - 1)] for i in range(len(tokens))
    ]
    logprobs = [-float(draw(st.integers(0, 50))) / 7 for _ in tokens]
    return Generation(tokens, logprobs, per_token, "stop"), draw(st.booleans())


def reference(turns):
    """The layout written out token by token, from the prompts and replies as given."""
    out_ids, mask, logprobs, versions = [], [], [], []
    for prompt, (gen, trained) in turns:
        out_ids += prompt
        mask += [0] * len(prompt)
        logprobs += [0.0] * len(prompt)
        versions += [-1] * len(prompt)
        out_ids += gen.token_ids
        mask += [int(trained)] * len(gen.token_ids)
        logprobs += gen.logprobs
        versions += gen.versions
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
