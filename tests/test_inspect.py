"""`millstream inspect`: finding episodes in a store and reading one, in the terminal and on the
web page, the page driven by a real headless browser (Debian's chromium).

The store here is written by the store's own writer from episodes rendered with the tiny model's
real chat template: one GRPO group of two trained members and a member that failed mid-turn
(its scene: one turn done, a request cut by its timeout after three tokens). A real run's store
is checked by tests/test_run.py (its failed episodes are found by cause there too).
"""

import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import orjson
import pytest

from millstream.envpool.chat import ChatFormat
from millstream.shared.inspect.web import start_server
from millstream.shared.store.trajstore import (
    STORE_FILE,
    episode_from_failure,
    episode_from_trajectory,
)
from millstream.shared.store.writer import StoreWriter
from millstream.shared.wire import Cause, EpisodeFailed, FailedRequest, Scene, Trajectory

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _episode(chat: ChatFormat, episode_id: str, replies: list[str], reward: float) -> Trajectory:
    ids = chat.first_prompt("You play a game.", "Say something even.")
    mask, logprobs, versions, starts, ends, texts = (
        [0] * len(ids),
        [0.0] * len(ids),
        [-1] * len(ids),
        [],
        [],
        [],
    )
    texts.append("Say something even.")
    for t, reply in enumerate(replies):
        reply_ids = chat.encode(reply)
        starts.append(len(ids))
        ids += reply_ids
        mask += [1] * len(reply_ids)
        logprobs += [-0.1 * (i + 1) for i in range(len(reply_ids))]
        versions += [3 + t] * len(reply_ids)
        ends.append(len(ids))
        texts += [reply, f"observation {t}"]
        bridge = chat.close_turn(reply_ids) + chat.next_prompt(f"observation {t}")
        ids += bridge
        mask += [0] * len(bridge)
        logprobs += [0.0] * len(bridge)
        versions += [-1] * len(bridge)
    return Trajectory(
        episode_id=episode_id,
        group_id="g7",
        seed=7,
        env="evenchars",
        token_ids=ids,
        loss_mask=mask,
        logprobs=logprobs,
        versions=versions,
        reward=reward,
        turn_rewards=[reward / len(replies)] * len(replies),
        num_turns=len(replies),
        group_size=3,
        duration_s=0.5,
        turn_starts=starts,
        turn_ends=ends,
        texts=texts,
        request_ids=[f"w0-{episode_id}-{t}" for t in range(len(replies))],
    )


@pytest.fixture(scope="module")
def run_dir(tiny_model_dir):
    """A run directory with a config naming the tiny model and a store of one group."""
    path = Path(tempfile.mkdtemp(prefix="inspect-"))
    (path / "config.toml").write_text(f'[model]\npath = "{tiny_model_dir}"\n')
    chat = ChatFormat.from_model_dir(tiny_model_dir)
    writer = StoreWriter(path / STORE_FILE)
    for episode_id, replies, reward in (("e0", ["abba", "even more"], 0.8), ("e1", ["xyz"], 0.1)):
        traj = _episode(chat, episode_id, replies, reward)
        advantages = [0.5 * m * (1 if reward > 0.5 else -1) for m in traj.loss_mask]
        writer.put(
            episode_from_trajectory(traj, fate="trained", step=4, trained_version=4, advantages=advantages)
        )
    done = _episode(chat, "e2", ["first turn"], 0.0)
    partial = chat.encode("cut sh")
    scene = Scene(
        env="evenchars",
        seed=7,
        token_ids=done.token_ids,
        loss_mask=done.loss_mask,
        logprobs=done.logprobs,
        versions=done.versions,
        turn_rewards=[0.3],
        turn_starts=done.turn_starts,
        turn_ends=done.turn_ends,
        texts=done.texts,
        request_ids=done.request_ids,
        duration_s=2.0,
        request=FailedRequest(
            "w0-e2-1", 1, partial, [-0.7] * len(partial), [4] * len(partial), "no final delta"
        ),
    )
    failed = EpisodeFailed(
        "e2", "g7", 3, Cause.ACTOR_TIMEOUT, "actor_timeout: no final delta within 0.4s", scene
    )
    writer.put(episode_from_failure(failed, step=4))
    writer.close()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def inspect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "millstream.shared.launch.cli", "inspect", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_failed_episode_is_found_by_its_cause_and_shows_its_scene(run_dir):
    listing = inspect(str(run_dir), "--cause", "actor_timeout")
    assert listing.returncode == 0, listing.stderr
    assert "1 episodes match: failed 1 (failed/actor_timeout 1)" in listing.stdout
    row = next(line.split()[0] for line in listing.stdout.splitlines() if line.rstrip().endswith(" e2"))
    shown = inspect(str(run_dir), "--episode", row)
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert "fate failed (actor_timeout)" in out and "reward -" in out  # a failure has no reward
    assert "<|im_start|>" in out  # special tokens visible in the prompt
    assert "first turn" in out  # the turn that was played
    assert "!!! request w0-e2-1 (turn 1) failed: no final delta" in out
    assert "tokens had arrived: 'cut sh'" in out


def test_reading_an_episode_imports_no_model_library(run_dir):
    """Decoding goes through `tokenizers` (a core dependency): transformers or torch would cost a
    look at one episode 12 s on a quiet machine, up to 86 s on a loaded one."""
    code = (
        "import sys\n"
        "from millstream.shared.inspect.cli import main\n"
        f"assert main([{str(run_dir)!r}, '--episode', '1', '--tokens']) == 0\n"
        "print(sorted(m for m in ('transformers', 'torch', 'vllm') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_queries_by_request_id_text_reward_and_step(run_dir):
    by_request = inspect(str(run_dir), "--request", "w0-e0-1")
    assert by_request.stdout.splitlines()[0].startswith("1 episodes match: trained 1")
    assert by_request.stdout.rstrip().endswith(" e0")
    assert inspect(str(run_dir), "--text", "even more").stdout.rstrip().endswith(" e0")
    rewarded = inspect(str(run_dir), "--reward-min", "0.5").stdout
    assert "1 episodes match" in rewarded and " e0" in rewarded and " e1" not in rewarded
    assert inspect(str(run_dir), "--step", "5:9").stdout.startswith("0 episodes match")
    tokens = inspect(str(run_dir), "--episode", "e0", "--tokens").stdout
    assert "  v3  adv +0.500" in tokens and "  v4  adv +0.500" in tokens  # per-token lines


@pytest.mark.parametrize(
    "args, message",
    [
        (["--step", "5:x"], "--step must be N or A:B"),
        (["--step", "9:5"], "range '9:5' is empty"),
        (["--episode", "nope"], "no episode 'nope'"),
        (["--limit", "0"], "limit must be at least 1"),
    ],
)
def test_bad_filters_are_one_line_errors(run_dir, args, message):
    result = inspect(str(run_dir), *args)
    assert result.returncode == 2 and message in result.stderr and len(result.stderr.splitlines()) == 1


def test_a_directory_without_a_store_is_named(tmp_path):
    result = inspect(str(tmp_path))
    assert result.returncode == 2 and f"no trajectory store at {tmp_path / STORE_FILE}" in result.stderr


def test_the_server_answers_json_and_refuses_the_network(run_dir):
    server, _ = start_server(run_dir, "127.0.0.1", 0)
    port = server.server_address[1]
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/episodes?fate=failed", timeout=10) as r:
            rows = orjson.loads(r.read())
        assert [r["episode_id"] for r in rows] == ["e2"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/episode/{rows[0]['id']}", timeout=10) as r:
            shown = orjson.loads(r.read())
        assert [m["episode_id"] for m in shown["group"]] == ["e0", "e1", "e2"]
        with pytest.raises(urllib.error.HTTPError) as bad:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/episodes?step=x", timeout=10)
        assert bad.value.code == 400
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(ValueError, match="not a loopback address"):
        start_server(run_dir, "0.0.0.0", 0)


def render(url: str, tmp_path: Path) -> str:
    """The page's DOM after its scripts ran, as headless chromium sees it."""
    result = subprocess.run(
        [
            CHROMIUM or "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'chromium'}",
            "--virtual-time-budget=8000",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_the_web_page_renders_episodes_in_a_real_browser(run_dir, tmp_path, tiny_model_dir):
    tiny = tiny_model_dir
    assert CHROMIUM, "Debian's chromium is needed (make install installs it: apt-get install chromium)"
    server, _ = start_server(run_dir, "127.0.0.1", 0)
    port = server.server_address[1]
    try:
        failed_row = orjson.loads(
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/episodes?fate=failed").read()
        )
        row = failed_row[0]["id"]
        dom = render(f"http://127.0.0.1:{port}/#episode={row}", tmp_path)
    finally:
        server.shutdown()
        server.server_close()
    # The list: every episode, the failed one with its cause.
    assert "3 episodes: failed 1, trained 2" in dom
    assert '<td class="fate">failed</td><td class="cause">actor_timeout</td>' in dom
    # The episode: its turn, the prompt's special tokens visible and marked, reply tokens shaded
    # with their logprob and version in the title.
    assert f"episode e2 (row {row})" in dom and "fate failed (actor_timeout)" in dom
    assert '<span class="tok special"' in dom and "&lt;|im_start|&gt;" in dom
    assert 'title="id ' in dom and "· logprob -0.100 · v3" in dom and 'style="background: rgb(' in dom
    # The scene: the request that was cut, with what had arrived.
    assert "request w0-e2-1 (turn 1) failed: no final delta" in dom
    assert f"{len(ChatFormat.from_model_dir(tiny).encode('cut sh'))} tokens had arrived" in dom
    # The group side by side: three members, this one marked.
    assert dom.count('class="member') == 3 and 'class="member current"' in dom
