"""Rules of the game environments: frozenlake, sokoban, countdown, guessnumber.

Rule tests play hand-built states (the generated one is replaced after reset) so every reward and
anchor below is computed by hand; generator tests check, with hypothesis, that every generated
task is solvable, and that a seed always gives the same task.
"""

from __future__ import annotations

import random
from collections import deque

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from millstream.envpool.envs import env_names, make_env
from millstream.envpool.envs.games.countdown import (
    Countdown,
    evaluate,
    make_task,
    parse_expression,
    used_numbers,
)
from millstream.envpool.envs.games.frozenlake import FrozenLake, generate_lake
from millstream.envpool.envs.games.guessnumber import GuessNumber
from millstream.envpool.envs.games.sokoban import MOVES as SOKOBAN_MOVES
from millstream.envpool.envs.games.sokoban import Level, Sokoban, generate_level

GARBAGE = "\x00\ufffd<garbage>"
SEEDS = st.integers(min_value=0, max_value=2**63)


def play(env, seed, actions, backend="trio"):
    """Reset with `seed`, send `actions` until the episode ends; (first observation, step results)."""

    async def episode():
        results = []
        first = await env.reset(seed)
        for action in actions:
            results.append(await env.step(action))
            if results[-1].done:
                break
        return first, results

    return anyio.run(episode, backend=backend)


def step(env, action):
    return anyio.run(env.step, action, backend="trio")


def ans(*moves):
    return "<think>plan</think><answer>" + " || ".join(moves) + "</answer>"


def test_the_four_games_are_registered_and_built_by_name():
    assert {"frozenlake", "sokoban", "countdown", "guessnumber"} <= set(env_names())
    assert isinstance(make_env("sokoban", {"dim_room": [7, 7]}), Sokoban)
    assert isinstance(make_env("frozenlake", {"slippery": True}), FrozenLake)


@pytest.mark.parametrize(
    "name, args, bad",
    [
        ("frozenlake", {"size": 1}, "size"),
        ("frozenlake", {"hole_prob": 0.9}, "hole_prob"),
        ("frozenlake", {"max_actions_per_turn": 0}, "max_actions_per_turn"),
        ("sokoban", {"dim_room": (3, 6)}, "dim_room"),
        ("sokoban", {"dim_room": 6}, "dim_room"),
        ("sokoban", {"num_boxes": 0}, "num_boxes"),
        ("sokoban", {"num_steps": 0}, "num_steps"),
        ("sokoban", {"num_steps": 21}, "num_steps"),
        ("sokoban", {"dim_room": (5, 5), "num_boxes": 3, "num_steps": 1}, "dim_room"),  # no such level
        ("sokoban", {"max_actions_per_turn": 0}, "max_actions_per_turn"),
        ("countdown", {"min_numbers": 1}, "min_numbers"),
        ("countdown", {"min_numbers": 4, "max_numbers": 3}, "max_numbers"),
        ("countdown", {"max_number": 1}, "max_number"),
        ("countdown", {"max_target": 0}, "max_target"),
        ("guessnumber", {"high": 1}, "high"),
        ("guessnumber", {"max_guesses": 0}, "max_guesses"),
    ],
)
def test_bad_arguments_are_named(name, args, bad):
    with pytest.raises(ValueError, match=bad):
        make_env(name, args)


# ---------------------------------------------------------------- frozenlake


def lake(holes=(), goal=(3, 3), player=(0, 0), **kwargs):
    """A 4x4 FrozenLake set to a hand-made lake."""
    env = FrozenLake(**kwargs)
    play(env, 0, [])
    env.holes, env.goal, env.start, env.player = frozenset(holes), goal, player, player
    return env


def test_frozenlake_renders_rows_of_cells():
    env = lake(holes=[(1, 1), (2, 3)], goal=(3, 0), player=(0, 2))
    assert env.render() == "_ _ P _\n_ O _ _\n_ _ _ O\nG _ _ _"


def test_frozenlake_reaching_the_goal_pays_one_and_ends():
    env = lake(holes=[(1, 1)], goal=(0, 2))
    result = step(env, ans("Right", "right"))
    assert (result.reward, result.done) == (1.0, True)
    assert result.info == {"valid": True, "success": True, "actions_executed": 2}
    assert result.observation.anchor == "0,2"
    assert result.observation.text.splitlines()[0] == "_ _ √ _"


def test_frozenlake_hole_ends_with_zero_and_skips_the_remaining_moves():
    env = lake(holes=[(1, 0)])
    result = step(env, ans("Down", "Right", "Right"))
    assert (result.reward, result.done, result.info["success"]) == (0.0, True, False)
    assert result.info["actions_executed"] == 1
    assert result.observation.anchor == "1,0"
    assert result.observation.text.splitlines()[1] == "X _ _ _"
    with pytest.raises(RuntimeError):
        step(env, ans("Up"))


def test_frozenlake_moves_off_the_grid_stay_put():
    env = lake()
    result = step(env, ans("UP", "left", "Down"))
    assert (result.reward, result.done, result.info["valid"]) == (0.0, False, True)
    assert result.observation.anchor == "1,0"


@pytest.mark.parametrize(
    "action",
    [
        "no tags at all",
        ans("Jump"),
        ans("Down", "Down", "Down", "Down"),
        ans("Down", "sideways"),
        "<answer></answer>",
        GARBAGE,
    ],
)
def test_frozenlake_invalid_answer_costs_the_penalty_and_changes_nothing(action):
    env = lake(player=(1, 2))
    result = step(env, action)
    assert (result.reward, result.done) == (-0.1, False)
    assert result.info == {"valid": False, "success": False}
    assert result.observation.anchor == "1,2" and env.player == (1, 2)
    assert result.observation.text.endswith(env.render())


def test_frozenlake_max_actions_per_turn_is_a_limit():
    env = lake(max_actions_per_turn=1)
    assert step(env, ans("Down", "Down")).info["valid"] is False
    assert step(env, ans("Down")).observation.anchor == "1,0"
    assert "||" not in env.system_prompt


def test_frozenlake_anchor_is_the_state_not_the_path():
    a, b = lake(), lake()
    via_right, via_down = step(a, ans("Right", "Down")), step(b, ans("Down", "Right"))
    assert via_right.observation.anchor == via_down.observation.anchor == "1,1"
    assert step(a, ans("Right")).observation.anchor != step(b, ans("Down")).observation.anchor


def test_frozenlake_slips_to_the_sides_a_third_of_the_time_each():
    ends = []
    for seed in range(90):
        env = FrozenLake(hole_prob=0.0, slippery=True)
        play(env, seed, [])
        env.goal, env.player = (3, 3), (1, 1)
        ends.append(step(env, ans("Right")).observation.anchor)
    # Right slips to Up or Down (perpendicular), never to Left.
    assert set(ends) == {"1,2", "0,1", "2,1"}
    assert all(15 <= ends.count(end) <= 45 for end in set(ends))


@pytest.mark.parametrize("slippery", [False, True])
def test_frozenlake_same_seed_same_episode(slippery):
    moves = [ans("Down", "Right"), ans("Jump"), ans("Right", "Down"), ans("Left")]
    runs = [play(FrozenLake(slippery=slippery), 123, moves) for _ in range(2)]
    (first_a, steps_a), (first_b, steps_b) = runs
    assert first_a == first_b and steps_a == steps_b


def test_frozenlake_seeds_give_different_lakes():
    assert len({play(FrozenLake(), seed, [])[0].text for seed in range(20)}) >= 15


def bfs_reachable(size, holes, start, goal):
    seen, todo = {start}, deque([start])
    while todo:
        r, c = todo.popleft()
        for nxt in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
            if 0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in holes and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return goal in seen


@settings(max_examples=200, deadline=None)
@given(seed=SEEDS, size=st.integers(2, 8), hole_prob=st.floats(0.0, 0.5))
def test_frozenlake_every_lake_has_a_path(seed, size, hole_prob):
    holes, start, goal = generate_lake(size, hole_prob, random.Random(seed))
    assert start != goal and start not in holes and goal not in holes
    assert bfs_reachable(size, holes, start, goal)
    assert generate_lake(size, hole_prob, random.Random(seed)) == (holes, start, goal)


# ---------------------------------------------------------------- sokoban


def room(rows):
    """A Sokoban env set to a hand-drawn level (same symbols as the rendering, no spaces)."""
    floor, targets, boxes, player = set(), set(), set(), None
    for r, line in enumerate(rows):
        for c, ch in enumerate(line):
            if ch != "#":
                floor.add((r, c))
            if ch in "O√S":
                targets.add((r, c))
            if ch in "X√":
                boxes.add((r, c))
            if ch in "PS":
                player = (r, c)
    env = Sokoban()
    play(env, 0, [])
    env.level = Level(len(rows), len(rows[0]), frozenset(floor), frozenset(targets), player, frozenset(boxes))
    env.player, env.boxes = player, set(boxes)
    return env


CORRIDOR = ["#######", "#_____#", "#P_X_O#", "#_____#", "#######"]


def test_sokoban_renders_every_symbol():
    env = room(["######", "#S_X_#", "#√O__#", "######"])
    assert env.render() == "# # # # # #\n# S _ X _ #\n# √ O _ _ #\n# # # # # #"
    assert env.anchor() == "1,1|1,3;2,1"


def test_sokoban_pushing_the_last_box_home_pays_gym_sokoban_rewards():
    env = room(CORRIDOR)
    assert env.anchor() == "2,1|2,3"
    walk = step(env, ans("Right"))
    assert (walk.reward, walk.done, walk.observation.anchor) == (-0.1, False, "2,2|2,3")
    result = step(env, ans("Right", "Right", "Up"))
    # -0.1 (push) + (-0.1 + 1 + 10) (push onto the target, all boxes home); "Up" is ignored.
    assert result.reward == 10.8
    assert (result.done, result.info["success"], result.info["actions_executed"]) == (True, True, 2)
    assert result.observation.anchor == "2,4|2,5"
    assert result.observation.text.splitlines()[2] == "# _ _ _ P √ #"


def test_sokoban_box_on_and_off_a_target():
    env = room(["#######", "#O____#", "#_PXO_#", "#_X___#", "#######"])
    on = step(env, ans("Right"))
    assert (on.reward, on.done, on.info["boxes_on_target"]) == (0.9, False, 1)
    off = step(env, ans("Right"))
    assert (off.reward, off.done, off.info["boxes_on_target"]) == (-1.1, False, 0)
    stuck = step(env, ans("Right"))  # box against the wall: nobody moves
    assert (stuck.reward, stuck.observation.anchor) == (-0.1, "2,4|2,5;3,2")


def test_sokoban_walls_and_box_rows_block():
    env = room(["######", "#PXX_#", "#__OO#", "######"])
    result = step(env, ans("Right", "Up", "Left"))  # two boxes in a row, a wall, a wall
    assert (result.reward, result.observation.anchor) == (-0.3, "1,1|1,2;1,3")


@pytest.mark.parametrize(
    "action", ["Right", ans("Push"), ans("Right", "Right", "Right", "Right"), "<answer>||</answer>", GARBAGE]
)
def test_sokoban_invalid_answer_costs_the_penalty_and_changes_nothing(action):
    env = room(CORRIDOR)
    result = step(env, action)
    assert (result.reward, result.done, result.info) == (-0.1, False, {"valid": False, "success": False})
    assert result.observation.anchor == "2,1|2,3" and env.boxes == {(2, 3)}
    assert result.observation.text.endswith(env.render())


def test_sokoban_anchor_is_the_state_not_the_path():
    a, b = room(CORRIDOR), room(CORRIDOR)
    assert step(a, ans("Up", "Down")).observation.anchor == step(b, ans("Down", "Up")).observation.anchor
    assert step(a, ans("Up")).observation.anchor != step(b, ans("Right")).observation.anchor


def test_sokoban_same_seed_same_episode_and_seeds_differ():
    moves = [ans("Up", "Left"), GARBAGE, ans("Down", "Right", "Right")]
    assert play(Sokoban(), 7, moves) == play(Sokoban(), 7, moves)
    assert len({play(Sokoban(), seed, [])[0].text for seed in range(20)}) >= 15


def shortest_solution(level, limit):
    """Moves of a shortest solution by BFS over (player, boxes), or None within `limit` moves."""
    start = (level.player, level.boxes)
    depth, todo = {start: 0}, deque([start])
    while todo:
        player, boxes = state = todo.popleft()
        if boxes == level.targets:
            return depth[state]
        if depth[state] == limit:
            continue
        for dr, dc in SOKOBAN_MOVES.values():
            nxt = (player[0] + dr, player[1] + dc)
            new_boxes = boxes
            if nxt in boxes:
                beyond = (nxt[0] + dr, nxt[1] + dc)
                if beyond not in level.floor or beyond in boxes:
                    continue
                new_boxes = boxes - {nxt} | {beyond}
            elif nxt not in level.floor:
                continue
            if (nxt, new_boxes) not in depth:
                depth[(nxt, new_boxes)] = depth[state] + 1
                todo.append((nxt, new_boxes))
    return None


@settings(max_examples=150, deadline=None)
@given(seed=SEEDS, dim=st.integers(5, 8), num_boxes=st.integers(1, 2), num_steps=st.integers(8, 20))
def test_sokoban_every_level_is_solvable_within_num_steps(seed, dim, num_boxes, num_steps):
    level = generate_level(random.Random(seed), dim, dim, num_boxes, num_steps)
    assert len(level.boxes) == len(level.targets) == num_boxes
    assert not level.boxes & level.targets
    assert level.boxes <= level.floor and level.targets <= level.floor and level.player in level.floor
    assert level.player not in level.boxes
    assert all(0 < r < dim - 1 and 0 < c < dim - 1 for r, c in level.floor)  # walled all round
    assert shortest_solution(level, num_steps) is not None


def test_sokoban_default_levels_fit_the_default_turns_and_vary():
    # Solvable in <= 8 moves (num_steps), and 4 turns x 3 moves allow 12.
    lengths = [shortest_solution(generate_level(random.Random(s), 6, 6, 1, 8), 8) for s in range(60)]
    assert None not in lengths and min(lengths) >= 1
    assert len(set(lengths)) >= 6  # easy and hard levels both occur


# ---------------------------------------------------------------- countdown


def task(numbers, target, **kwargs):
    env = Countdown(**kwargs)
    play(env, 0, [])
    env.numbers, env.target = numbers, target
    return env


@pytest.mark.parametrize(
    "numbers, target, answer, reward, success, numbers_ok",
    [
        ([3, 5, 7], 36, "(7 + 5) * 3", 1.0, True, True),
        ([3, 5, 7], 36, " 3*(5+7) ", 1.0, True, True),
        ([3, 5, 7], 36, "(7 - 5) * 3", 0.1, False, True),  # wrong value
        ([3, 5, 7], 36, "(7 + 5) * 3 * 3", 0.1, False, False),  # 3 used twice
        ([3, 5, 7], 36, "(7 + 5)", 0.1, False, False),  # 3 unused
        ([3, 5, 7], 36, "12 * 3", 0.1, False, False),  # a number not given
        ([2, 2, 9], 4, "9 / (2 - 2)", 0.1, False, True),  # division by zero
        ([1, 49, 49], 1, "1 / 49 * 49", 1.0, True, True),  # exact: 0.999... in floats
    ],
)
def test_countdown_scores_like_tinyzero(numbers, target, answer, reward, success, numbers_ok):
    result = step(task(numbers, target), f"<think>hm</think><answer>{answer}</answer>")
    assert (result.reward, result.done) == (reward, True)
    assert result.info == {"valid": True, "success": success, "numbers_ok": numbers_ok}
    assert result.observation.anchor == "done"


@pytest.mark.parametrize(
    "answer",
    [
        "(7 + 5) * 3",
        "<answer>(7 + 5) * 3",
        "<answer>7 + 5 +</answer>",
        "<answer>-3 + 7 * 5</answer>",
        "<answer>(7 + 5) ** 3</answer>",
        "<answer>7 // 5 * 3</answer>",
        "<answer>0x7 + 5 * 3</answer>",
        "<answer>__import__('os').system('true')</answer>",
        "<answer>7.0 + 5 * 3</answer>",
        "<answer></answer>",
        "<answer>" + "(" * 150 + "3" + ")" * 150 + "</answer>",
        GARBAGE,
        "<answer>(7 + 5) *\x00 3</answer>",
    ],
)
def test_countdown_unparseable_answers_get_the_format_penalty(answer):
    result = step(task([3, 5, 7], 36), answer)
    assert (result.reward, result.done, result.info) == (0.0, True, {"valid": False, "success": False})
    assert step(task([3, 5, 7], 36, format_penalty=-0.5), answer).reward == -0.5


def test_countdown_scores_are_arguments_and_the_last_answer_counts():
    env = task([3, 5, 7], 36, format_score=0.2, format_penalty=-1.0)
    assert step(env, "<answer>nope</answer>").reward == -1.0
    env = task([3, 5, 7], 36, format_score=0.2)
    assert step(env, "<answer>3 + 5 + 7</answer>").reward == 0.2
    env = task([3, 5, 7], 36)
    assert step(env, "<answer>3 + 5 + 7</answer> no, <answer>(7 + 5) * 3</answer>").reward == 1.0


def test_countdown_parser_takes_only_arithmetic():
    assert parse_expression("(" * 99 + "1" + ")" * 99) is not None
    tree = parse_expression("(44 + 19) - 35 / 7")
    assert sorted(used_numbers(tree)) == [7, 19, 35, 44] and evaluate(tree) == 58
    for text in ["a + 1", "True + 1", "[1] * 3", "1 < 2", "1e3", "1_000"]:
        assert parse_expression(text) is None


def test_countdown_one_turn_same_seed_same_task():
    first_a, _ = play(Countdown(), 5, [])
    first_b, [result] = play(Countdown(), 5, ["<answer>1</answer>"])
    assert first_a == first_b and first_a.anchor == "start"
    assert first_a.text.startswith("Numbers: ") and "Target: " in first_a.text
    assert result.done and result.reward == 0.1
    assert len({play(Countdown(), seed, [])[0].text for seed in range(20)}) == 20


@settings(max_examples=300, deadline=None)
@given(seed=SEEDS, lo=st.integers(2, 4), extra=st.integers(0, 2), max_number=st.integers(2, 99))
def test_countdown_every_target_is_reachable(seed, lo, extra, max_number):
    numbers, target, solution = make_task(random.Random(seed), lo, lo + extra, max_number, 100)
    assert lo <= len(numbers) <= lo + extra and all(1 <= n <= max_number for n in numbers)
    assert 1 <= target <= 100
    tree = parse_expression(solution)
    assert tree is not None and sorted(used_numbers(tree)) == sorted(numbers)
    assert evaluate(tree) == target


def test_countdown_generated_solution_wins_the_episode():
    env = Countdown()
    play(env, 11, [])
    assert step(env, f"<answer>{env.solution}</answer>").info["success"] is True


# ---------------------------------------------------------------- guessnumber


def secret(value, **kwargs):
    env = GuessNumber(**kwargs)
    play(env, 0, [])
    env.secret = value
    return env


def guess(n):
    return f"<think>bisect</think><answer>{n}</answer>"


def test_guessnumber_hints_narrow_the_interval_until_correct():
    env = secret(11)
    assert env.anchor() == "1-15/4"
    results = [step(env, guess(n)) for n in (8, 12, 10, 11)]
    assert [r.observation.anchor for r in results] == ["9-15/3", "9-11/2", "11-11/1", "solved"]
    assert [r.reward for r in results] == [0.0, 0.0, 0.0, 1.0]
    assert [r.done for r in results] == [False, False, False, True]
    assert "higher" in results[0].observation.text and "lower" in results[1].observation.text
    assert results[3].info == {"valid": True, "success": True}


def test_guessnumber_out_of_guesses_ends_with_zero():
    env = secret(1)
    results = [step(env, guess(n)) for n in (15, 14, 13, 12)]
    assert [r.done for r in results] == [False, False, False, True]
    assert results[-1].reward == 0.0 and results[-1].info["success"] is False
    assert results[-1].observation.anchor == "1-11/0"
    with pytest.raises(RuntimeError):
        step(env, guess(1))


@pytest.mark.parametrize(
    "action",
    [
        guess(0),
        guess(16),
        guess(-3),
        guess("eight"),
        guess("8 || 9"),
        guess("7.5"),
        "8",
        GARBAGE,
        guess("9" * 5000),
    ],
)
def test_guessnumber_invalid_guess_costs_the_penalty_and_no_guess(action):
    env = secret(6)
    result = step(env, action)
    assert (result.reward, result.done, result.info) == (-0.1, False, {"valid": False, "success": False})
    assert result.observation.anchor == "1-15/4" and env.left == 4


def test_guessnumber_equal_knowledge_is_an_equal_anchor():
    a, b = secret(6), secret(6)
    assert [step(a, guess(n)).observation.anchor for n in (8, 4)] == ["1-7/3", "5-7/2"]
    assert [step(b, guess(n)).observation.anchor for n in (4, 8)] == ["5-15/3", "5-7/2"]
    c = secret(6)
    redundant = [step(c, guess(n)) for n in (8, 10, 4, 2)]  # 10 and 2 are already excluded
    assert all(r.info["valid"] for r in redundant)
    assert [r.observation.anchor for r in redundant] == ["1-7/3", "1-7/2", "5-7/1", "5-7/0"]


def test_guessnumber_bisection_always_wins_with_the_defaults():
    for value in range(1, 16):
        env, result = secret(value), None
        while result is None or not result.done:
            result = step(env, guess((env.lo + env.hi) // 2))
        assert result.info["success"], value


def secret_of(seed):
    env = GuessNumber()
    play(env, seed, [])
    return env.secret


def test_guessnumber_seed_decides_the_secret():
    assert [secret_of(9) for _ in range(3)] == [secret_of(9)] * 3
    assert {secret_of(seed) for seed in range(60)} == set(range(1, 16))


def test_games_run_under_asyncio_too():
    _, [result] = play(GuessNumber(), 3, [guess(8)], backend="asyncio")
    assert result.info["valid"] is True
    _, [result] = play(Sokoban(), 3, [ans("Up")], backend="asyncio")
    assert result.info["valid"] is True
