"""The tool-use environments: `search` (Search-R1 over a shipped corpus, BM25) and `pytool`
(Python in a sandboxed subprocess). Rules, rewards, anchors, determinism, and the sandbox's limits."""

import json
import os
from pathlib import Path

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from millstream.envpool.envs import make_env
from millstream.envpool.envs.tools.pytool import (
    TEMPLATES,
    Task,
    _collatz_steps,
    _count_primes_below,
    _divisor_sum,
    _fibonacci_mod,
    make_task,
    parse_integer,
    run_python,
)
from millstream.envpool.envs.tools.sandbox.run import _limiter
from millstream.envpool.envs.tools.search import (
    BM25,
    DEFAULT_CORPUS,
    DEFAULT_QUESTIONS,
    Passage,
    load_corpus,
    load_questions,
    normalize_answer,
)

STORM_CLOCK_SEED = 336  # random.Random(336).randrange(260) == 3: the storm-clock two-hop question


def play(env, seed, actions):
    """Reset with `seed`, then step through `actions`; returns (first observation, results)."""

    async def go():
        first = await env.reset(seed)
        return first, [await env.step(a) for a in actions]

    return anyio.run(go, backend="trio")  # the project's default backend


# ---------------------------------------------------------------- search: retrieval and data


def _toy_index():
    return BM25(
        [
            Passage("a", "Apple", "red apple"),
            Passage("b", "Pear", "green pear"),
            Passage("c", "Mix", "red pear and green apple"),
        ]
    )


def test_bm25_scores_are_okapi_by_hand():
    # N=3, lengths 3,3,6 (avg 4); "red" in 2 docs: idf = ln(1.5/2.5 + 1) = ln 1.6 = 0.470004.
    # doc a: 0.470004 * 2.2 / (1 + 1.2 * (0.25 + 0.75 * 3/4)) = 0.470004 * 2.2 / 1.975 = 0.523549
    # doc c: 0.470004 * 2.2 / (1 + 1.2 * (0.25 + 0.75 * 6/4)) = 0.470004 * 2.2 / 2.65 = 0.390192
    scores = _toy_index().scores("RED!")
    assert scores == pytest.approx({0: 0.523549, 2: 0.390192}, abs=1e-6)
    assert _toy_index().scores("red red") == scores  # a repeated query word counts once
    # "apple": tf=2 in a: 0.4700036 * 2 * 2.2 / (2 + 0.975) = 0.695131
    assert _toy_index().scores("apple")[0] == pytest.approx(0.695131, abs=1e-6)


def test_bm25_ranks_best_first_and_skips_unrelated_passages():
    index = _toy_index()
    assert [p.id for p in index.search("green pear", 3)] == ["b", "c"]
    assert [p.id for p in index.search("apple", 1)] == ["a"]
    assert index.search("banana", 3) == []


def test_index_is_built_once_per_corpus_file():
    assert load_corpus() is load_corpus(str(DEFAULT_CORPUS))
    assert make_env("search").index is make_env("search").index


def test_shipped_data_is_small_consistent_and_answerable():
    assert DEFAULT_CORPUS.stat().st_size + DEFAULT_QUESTIONS.stat().st_size < 200_000
    passages = {p.id: p for p in load_corpus().passages}
    questions = load_questions()
    assert 150 <= len(passages) <= 300 and len(questions) == 260
    assert sum(len(q["gold_ids"]) == 2 for q in questions) == 130  # half are two-hop
    for q in questions:
        evidence = normalize_answer(" ".join(passages[g].text for g in q["gold_ids"]))
        assert any(normalize_answer(a) in evidence for a in q["answers"]), q
        # the question itself finds the first hop: no question is hopeless for BM25
        assert q["gold_ids"][0] in [p.id for p in load_corpus().search(q["question"], 3)], q


def test_squad_normalisation():
    assert normalize_answer("  The Karvel-River! ") == "karvelriver"
    assert normalize_answer("an Apple a day") == "apple day"
    assert normalize_answer("1,846 m.") == "1846 m"


# ---------------------------------------------------------------- search: the game


def test_two_hop_episode_reads_both_passages_and_wins():
    first, (s1, s2, done) = play(
        make_env("search"),
        STORM_CLOCK_SEED,
        [
            "<think>look up</think><search>storm clock</search>",
            "<search>Haesko Quyhubia</search>",
            "<answer> byzund. </answer>",
        ],
    )
    assert first.text == "Question: In which town was the inventor of the storm clock born?"
    assert first.anchor == "q3|s0|"
    assert s1.observation.text.startswith(
        "<information>Doc 1(Title: Storm clock) The storm clock is a "
        "wooden device invented by Haesko Quyhubia in 1951"
    )
    assert "\nDoc 3(Title: " in s1.observation.text and s1.observation.text.endswith("</information>")
    assert (s1.reward, s1.done, s1.info["valid"], s1.info["gold_found"]) == (0.0, False, True, 1)
    assert s1.observation.anchor == "q3|s1|i13,i15,i17"
    assert "born in 1905 in Byzund" in s2.observation.text
    assert s2.observation.anchor == "q3|s2|i13,i15,i17,p24,p41" and s2.info["gold_found"] == 2
    assert (done.reward, done.done, done.info["success"]) == (1.0, True, True)
    assert done.observation.anchor == "q3|answered"


def test_wrong_answer_ends_with_zero():
    _, [result] = play(make_env("search"), STORM_CLOCK_SEED, ["<answer>Kriarovir</answer>"])
    assert (result.reward, result.done, result.info["valid"], result.info["success"]) == (
        0.0,
        True,
        True,
        False,
    )


@pytest.mark.parametrize(
    "action, reason",
    [
        ("I think it is Byzund.", "no_tag"),
        ("\x00\ufffd<garbage>", "no_tag"),
        ("<search>storm clock", "no_tag"),
        ("<search> ?! </search>", "empty_query"),
    ],
)
def test_invalid_replies_are_penalised_and_change_nothing(action, reason):
    first, [bad, good] = play(
        make_env("search", {"format_penalty": -0.25}),
        STORM_CLOCK_SEED,
        [action, "<search>storm clock</search>"],
    )
    assert (bad.reward, bad.done, bad.info["valid"], bad.info["reason"]) == (-0.25, False, False, reason)
    assert bad.observation.anchor == first.anchor == "q3|s0|"
    assert "<search>" in bad.observation.text and "<answer>" in bad.observation.text
    assert good.observation.anchor == "q3|s1|i13,i15,i17"  # the searches left were not spent


def test_search_limit_then_answer():
    _, (s1, s2, s3) = play(
        make_env("search", {"max_searches": 1}),
        STORM_CLOCK_SEED,
        ["<search>storm clock</search>", "<search>Haesko Quyhubia</search>", "<answer>Byzund</answer>"],
    )
    assert s2.info == {"valid": False, "success": False, "reason": "search_limit"}
    assert s2.reward == -0.1 and "used all 1 searches" in s2.observation.text
    assert s2.observation.anchor == s1.observation.anchor == "q3|s1|i13,i15,i17"
    assert s3.reward == 1.0 and s3.done


def test_first_tag_decides_and_topk_is_honoured():
    _, [answered] = play(
        make_env("search"), STORM_CLOCK_SEED, ["<answer>Byzund</answer><search>storm clock</search>"]
    )
    assert answered.done and answered.reward == 1.0
    _, [one] = play(
        make_env("search", {"topk": 1}), STORM_CLOCK_SEED, ["<search>storm clock</search><answer>x</answer>"]
    )
    assert one.observation.anchor == "q3|s1|i15" and "Doc 2" not in one.observation.text


def test_anchor_depends_on_passages_seen_not_on_query_wording():
    _, [a] = play(make_env("search"), STORM_CLOCK_SEED, ["<search>who invented the storm clock?</search>"])
    _, [b] = play(make_env("search"), STORM_CLOCK_SEED, ["<search>clock storm storm</search>"])
    _, [c] = play(make_env("search"), STORM_CLOCK_SEED, ["<search>Haesko Quyhubia</search>"])
    assert a.observation.anchor == b.observation.anchor == "q3|s1|i13,i15,i17"
    assert c.observation.anchor != a.observation.anchor


def test_search_is_deterministic_in_the_seed():
    firsts = [play(make_env("search"), seed, ["<search>river</search>"]) for seed in (7, 7)]
    assert firsts[0][0] == firsts[1][0] and firsts[0][1] == firsts[1][1]
    questions = {play(make_env("search"), seed, [])[0].text for seed in range(20)}
    assert len(questions) >= 15


@settings(max_examples=40, deadline=None)
@given(st.text(max_size=200))
def test_any_query_gives_a_short_observation(query):
    env = make_env("search")
    _, [result] = play(env, 0, [f"<search>{query}</search>"])
    assert len(result.observation.text) < 600 and not result.done
    assert result.info["valid"] == any(ch.isascii() and ch.isalnum() for ch in query.lower())


def test_search_rejects_bad_arguments(tmp_path):
    for args, name in [
        ({"topk": 0}, "topk"),
        ({"max_searches": -1}, "max_searches"),
        ({"passage_chars": 5}, "passage_chars"),
        ({"corpus_path": str(tmp_path / "none.jsonl")}, "corpus_path"),
    ]:
        with pytest.raises(ValueError, match=name):
            make_env("search", args)
    bad = tmp_path / "q.jsonl"
    bad.write_text(json.dumps({"question": "?", "answers": ["x"], "gold_ids": ["nope"]}) + "\n")
    with pytest.raises(ValueError, match="gold ids"):
        make_env("search", {"questions_path": str(bad)})
    bad.write_text(json.dumps({"question": "?", "answers": []}) + "\n")
    with pytest.raises(ValueError, match="questions_path"):
        make_env("search", {"questions_path": str(bad)})


# ---------------------------------------------------------------- pytool: tasks and grading


def test_ground_truth_helpers_match_known_values():
    assert _count_primes_below(1000) == 168 and _count_primes_below(2000) == 303
    assert _count_primes_below(3) == 1 and _count_primes_below(2) == 0
    assert _collatz_steps(27) == 111 and _collatz_steps(1) == 0
    assert [_fibonacci_mod(n, 1000) for n in (1, 2, 10, 20)] == [1, 1, 55, 765]  # F(20) = 6765
    assert _divisor_sum(12) == 28 and _divisor_sum(49) == 57


def test_tasks_come_from_the_seed():
    assert make_task(2) == Task("digit_sum:23,13", "What is the sum of the digits of 23**13?", 77)
    assert make_task(7) == Task("pow_mod:254,514002,86319", "What is 254**514002 mod 86319?", 3313)
    assert make_task(1, ("divisor_sum",)).key == "divisor_sum:606853"


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**63), st.sampled_from(sorted(TEMPLATES)))
def test_every_task_is_well_formed(seed, template):
    task = make_task(seed, (template,))
    assert task == make_task(seed, (template,))
    assert task.key.startswith(template + ":") and " " not in task.key
    assert isinstance(task.answer, int) and task.answer >= 0 and len(task.question) < 120
    assert all(str(v) in task.question for v in task.key.split(":")[1].split(","))


def test_parse_integer():
    assert [parse_integer(s) for s in ["1,234", " 1234. ", "\\boxed{1234}", "1234.0", "1 234", "-5"]] == [
        1234,
        1234,
        1234,
        1234,
        1234,
        -5,
    ]
    assert [parse_integer(s) for s in ["12.5", "about 12", "", "0x10", "1e3"]] == [None] * 5


# ---------------------------------------------------------------- pytool: the sandbox


def sandbox(code, backend="trio", **limits):
    return anyio.run(lambda: run_python(code, **limits), backend=backend)


def children():
    """Live processes of this test process running the sandbox's child script."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(ln.split(":", 1) for ln in status.read_text().splitlines() if ":" in ln)
            ppid = int(fields["PPid"])
            cmdline = (status.parent / "cmdline").read_bytes()
        except (OSError, KeyError, ValueError):
            continue
        if ppid == os.getpid() and b"sandbox/child.py" in cmdline:
            found.append(int(status.parent.name))
    return found


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_sandbox_captures_output_and_errors_in_order(backend):
    assert sandbox("print(sum(map(int, str(37**11))))", backend).output == "82\n"
    mixed = sandbox("import sys\nprint('out')\nprint('err', file=sys.stderr)\nx = 1 / 0")
    assert (mixed.output, mixed.status, mixed.returncode) == (
        "out\nerr\nline 4: ZeroDivisionError: division by zero\n",
        "error",
        1,
    )
    assert sandbox("def (").output == "line 1: SyntaxError: invalid syntax\n"
    assert sandbox("print(1)\x00").output == "SyntaxError: source code string cannot contain null bytes\n"
    assert sandbox("print(input())").output == "line 1: EOFError: EOF when reading a line\n"


def test_sandbox_has_no_environment_and_a_fresh_directory():
    result = sandbox(
        "import os\nprint(os.environ.get('HOME'), os.listdir('.'), os.path.basename(os.getcwd())[:7])"
    )
    assert result.output == "None [] pytool-\n"


@pytest.mark.parametrize("mode", ["strict", "weak"])
def test_wall_clock_timeout_kills_an_infinite_loop(mode):
    result = sandbox(
        "import time\nprint('on', flush=True)\nwhile True: time.sleep(0.01)", timeout_s=0.5, sandbox=mode
    )
    # The loop never ends by itself: a result at all, killed (-9), is the timer's work.
    assert result.status == "timeout" and result.returncode == -9 and result.output == "on\n"
    assert children() == []  # killed and reaped (tests/test_sandbox.py: its descendants too)


def test_a_cancelled_run_leaves_no_process_behind():
    async def go():
        with anyio.move_on_after(0.3):
            await run_python("while True: pass", timeout_s=30, cpu_s=30)
        return children()

    assert children() == []
    assert anyio.run(go, backend="trio") == []


def test_cpu_limit_stops_a_busy_loop():
    result = sandbox("while True: pass", cpu_s=1, timeout_s=20)
    assert result.status == "cpu_limit"


def test_memory_limit_stops_a_big_allocation():
    result = sandbox("x = bytearray(512 * 2**20)\nprint('allocated')", memory_mb=128)
    assert result.output == "line 1: MemoryError\n"
    assert sandbox("x = bytearray(16 * 2**20)\nprint('allocated')", memory_mb=128).output == "allocated\n"


@pytest.mark.parametrize(
    "code",
    [
        "import socket\nsocket.socket()",
        "import socket\nsocket.create_connection(('127.0.0.1', 80), timeout=1)",
        "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:9')",
    ],
)
def test_network_is_refused_with_a_clear_message(code):
    # urllib wraps the PermissionError in a URLError; the reason reaches the model either way
    assert "network access is disabled in this sandbox" in sandbox(code).output


def test_processes_and_big_outputs_are_stopped():
    forked = sandbox("import os\nos.fork()")
    assert forked.output == "line 2: PermissionError: os.fork is disabled in this sandbox\n"
    flood = sandbox("while True: print('x' * 100)", max_output_bytes=1000)
    assert flood.status == "truncated" and len(flood.output) == 1000
    assert "File too large" in sandbox("open('f', 'w').write('x' * 2**21)").output


def test_concurrent_sandboxes_are_capped_per_event_loop():
    seen = {}

    async def go():
        limiter = _limiter(2)
        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(
                    lambda: run_python("import time\ntime.sleep(60)", timeout_s=90, max_concurrent=2)
                )
            with anyio.fail_after(30):  # all five asked: two run, three wait (and stay waiting)
                while limiter.statistics().tasks_waiting < 3:
                    await anyio.sleep(0.01)
            seen.update(borrowed=limiter.borrowed_tokens, waiting=limiter.statistics().tasks_waiting)
            tg.cancel_scope.cancel()  # the sandboxes are killed (test_a_cancelled_run_leaves_...)

    anyio.run(go)
    assert seen == {"borrowed": 2, "waiting": 3}
    # a limiter belongs to one event loop: a new loop (or another backend) gets its own
    assert anyio.run(lambda: run_python("print(1)", max_concurrent=2), backend="asyncio").output == "1\n"


# ---------------------------------------------------------------- pytool: the game


def test_compute_then_answer_wins():
    env = make_env("pytool", {"templates": ["prime_count"]})
    code = "n = 19651\nprint(sum(all(k % d for d in range(2, math.isqrt(k) + 1)) for k in range(2, n)))"
    first, (ran, done) = play(env, 1, [f"<python>import math\n{code}</python>", "<answer>2,225</answer>"])
    assert first.text == "Question: How many primes are there below 19651?"
    assert first.anchor == "prime_count:19651|r0|-"
    assert ran.observation.text == "<output>2225</output>" and ran.info["tool_status"] == "ok"
    assert (ran.reward, ran.done, ran.info["valid"]) == (0.0, False, True)
    assert ran.observation.anchor.startswith("prime_count:19651|r1|")
    assert (done.reward, done.done, done.info["success"]) == (1.0, True, True)
    assert done.observation.anchor == "prime_count:19651|answered"


def test_wrong_answer_and_tool_errors():
    _, (err, wrong) = play(
        make_env("pytool"), 2, ["<python>print(undefined)</python>", "<answer>78</answer>"]
    )
    assert err.observation.text == "<output>line 1: NameError: name 'undefined' is not defined</output>"
    assert err.info["valid"] and err.info["tool_status"] == "error"
    assert (wrong.reward, wrong.done, wrong.info["success"]) == (0.0, True, False)
    _, [silent] = play(make_env("pytool"), 2, ["<python>x = 1</python>"])
    assert silent.observation.text == "<output>(no output; print what you need)</output>"
    _, [slow] = play(make_env("pytool", {"timeout_s": 0.3}), 2, ["<python>while 1: pass</python>"])
    assert slow.observation.text == "<output>TimeoutError: stopped after 0.3 s</output>"


@pytest.mark.parametrize(
    "action, reason",
    [
        ("The answer is 77.", "no_tag"),
        ("\x00\ufffd<garbage>", "no_tag"),
        ("<python>  </python>", "empty_code"),
        ("<python>print(1)", "no_tag"),
    ],
)
def test_pytool_invalid_replies_are_penalised_and_change_nothing(action, reason):
    first, [bad, answer] = play(make_env("pytool"), 2, [action, "<answer>77</answer>"])
    assert (bad.reward, bad.done, bad.info["valid"], bad.info["reason"]) == (-0.1, False, False, reason)
    assert bad.observation.anchor == first.anchor == "digit_sum:23,13|r0|-"
    assert answer.reward == 1.0


def test_run_limit_fenced_code_and_long_output():
    env = make_env("pytool", {"max_runs": 1, "max_output_chars": 40})
    _, (long, limited) = play(
        env,
        2,
        ["<python>```python\nprint('a' * 30)\nprint('b' * 30)\n```</python>", "<python>print(1)</python>"],
    )
    assert long.observation.text == f"<output>{'a' * 13}\n...\n{'b' * 22}</output>"
    assert (limited.reward, limited.info["reason"]) == (-0.1, "run_limit")
    assert limited.observation.anchor == long.observation.anchor


def test_pytool_anchors_follow_the_outputs_seen():
    runs = {
        code: play(make_env("pytool"), 2, [f"<python>{code}</python>"])[1][0].observation.anchor
        for code in ["print(77)", "print(70 + 7)", "print(76)"]
    }
    assert runs["print(77)"] == runs["print(70 + 7)"] != runs["print(76)"]
    assert play(make_env("pytool"), 5, [])[0] == play(make_env("pytool"), 5, [])[0]
    assert len({play(make_env("pytool"), s, [])[0].anchor for s in range(20)}) == 20


def test_pytool_rejects_bad_arguments():
    for args, name in [
        ({"templates": ["nope"]}, "templates"),
        ({"templates": []}, "templates"),
        ({"max_runs": -1}, "max_runs"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"memory_mb": 1}, "memory_mb"),
        ({"max_concurrent": 0}, "max_concurrent"),
        ({"cpu_s": 1.5}, "cpu_s"),
    ]:
        with pytest.raises(ValueError, match=name):
            make_env("pytool", args)


def test_both_environments_are_registered_with_short_prompts():
    for name in ("search", "pytool"):
        env = make_env(name)
        first = play(env, 0, [])[0]
        assert len(env.system_prompt) + len(first.text) < 800
