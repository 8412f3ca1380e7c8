"""Sokoban as in RAGEN (rules and rewards of gym-sokoban): push every box onto a target.

Levels are generated from the seed the way gym-sokoban does (Schrader, "gym-sokoban", 2018):
1. a room of `dim_room` (default 6x6) walled all round, its floor carved by gym-sokoban's random
   walk (1.5 * (h + w) steps, turning with probability 0.35, opening one of its small masks at
   each step);
2. `num_boxes` targets (default 1) on random floor cells, each with its box on it: solved;
3. reverse play from the solved state: the player walks away from any cell, pulling the box
   behind it or not. Each reverse move undoes one forward move, so every state reached is
   solvable. gym-sokoban searches these depth-first and keeps the one whose boxes moved most;
   here they are searched breadth-first up to `num_steps` (default 8) moves, which gives each
   state the exact length of its shortest solution, and the level is a random state with no box
   on a target, at a distance drawn uniformly among the distances reached (far states outnumber
   near ones and would otherwise crowd them out). So every level is solvable in at most
   `num_steps` moves, and easy and hard ones both occur. A room that allows no such state is
   drawn again (from the same generator: a seed always gives the same level).

Moves are Up, Down, Left, Right (case-insensitive), several per turn separated by "||" as in
RAGEN, at most `max_actions_per_turn` (default 3). The player walks onto free floor and pushes a
box when the cell beyond it is free; into a wall, or a box that cannot move, it stays put.
Rewards (gym-sokoban, as RAGEN uses them), summed over the moves of a turn: -0.1 per move, +1
when a push puts a box on a target, -1 when one takes a box off, +10 more when all boxes are on
targets, which ends the episode (success); moves after that are ignored. An answer that is
missing, names an unknown move or has too many is invalid as a whole: `format_penalty` (default
-0.1), `valid=False`, nothing moves. A stuck level goes on until the episode's turn limit.

Observation: the room, one row a line, cells separated by spaces, in RAGEN's symbols: # wall,
_ floor, O target, X box, √ box on target, P player, S player on a target. Anchor: the player's
cell then the sorted box cells, "r,c|r,c;r,c" (walls and targets are fixed by the shared seed).
"""

from __future__ import annotations

import random

from millstream.envpool.envs.base import Observation, StepResult, parse_moves, register

__all__ = ["Sokoban", "Level", "generate_level", "MOVES"]

MOVES: dict[str, tuple[int, int]] = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}

Cell = tuple[int, int]


class Level:
    """A generated level: its floor and targets (fixed), and the start of player and boxes."""

    def __init__(
        self,
        height: int,
        width: int,
        floor: frozenset[Cell],
        targets: frozenset[Cell],
        player: Cell,
        boxes: frozenset[Cell],
    ) -> None:
        self.height, self.width = height, width
        self.floor, self.targets, self.player, self.boxes = floor, targets, player, boxes


# gym-sokoban's 3x3 masks, as offsets from the walker: each step opens one of these shapes.
_MASKS = [
    ((0, -1), (0, 0), (0, 1)),
    ((-1, 0), (0, 0), (1, 0)),
    ((0, -1), (0, 0), (1, 0)),
    ((0, -1), (0, 0), (1, -1), (1, 0)),
    ((0, 0), (0, 1), (1, 0)),
]


def _carve_floor(rng: random.Random, height: int, width: int) -> frozenset[Cell]:
    # gym-sokoban's topology walk: 1.5 * (h + w) steps inside the border, changing direction with
    # probability 0.35, opening a random mask around the walker at each step.
    directions = list(MOVES.values())
    r, c = rng.randrange(1, height - 1), rng.randrange(1, width - 1)
    dr, dc = rng.choice(directions)
    floor: set[Cell] = set()
    for _ in range(int(1.5 * (height + width))):
        if rng.random() < 0.35:
            dr, dc = rng.choice(directions)
        r, c = min(max(r + dr, 1), height - 2), min(max(c + dc, 1), width - 2)
        for mr, mc in rng.choice(_MASKS):
            if 0 < r + mr < height - 1 and 0 < c + mc < width - 1:
                floor.add((r + mr, c + mc))
    return frozenset(floor)


def _reverse_play(
    floor: frozenset[Cell], targets: frozenset[Cell], num_steps: int
) -> list[tuple[Cell, frozenset[Cell], int]]:
    """Every state within `num_steps` reverse moves of a solved one, with its distance, in
    breadth-first order: the distance is the length of the state's shortest solution."""
    directions = list(MOVES.values())
    start = [(p, targets) for p in sorted(floor - targets)]
    depth = dict.fromkeys(start, 0)
    order = list(start)
    for state in order:  # grows while it is walked: a breadth-first queue
        if depth[state] == num_steps:
            continue
        player, boxes = state
        for dr, dc in directions:
            nxt = (player[0] + dr, player[1] + dc)
            if nxt not in floor or nxt in boxes:
                continue
            behind = (player[0] - dr, player[1] - dc)
            # Walking away, with or without pulling the box behind: each undoes one forward move.
            options = [(nxt, boxes)]
            if behind in boxes:
                options.append((nxt, boxes - {behind} | {player}))
            for option in options:
                if option not in depth:
                    depth[option] = depth[state] + 1
                    order.append(option)
    return [(player, boxes, depth[(player, boxes)]) for player, boxes in order]


def generate_level(
    rng: random.Random, height: int, width: int, num_boxes: int, num_steps: int, max_tries: int = 1000
) -> Level:
    """A level solvable in at most `num_steps` moves with no box on a target (see the docstring)."""
    for _ in range(max_tries):
        floor = _carve_floor(rng, height, width)
        if len(floor) < num_boxes + 2:
            continue
        targets = frozenset(rng.sample(sorted(floor), num_boxes))
        by_distance: dict[int, list[tuple[Cell, frozenset[Cell]]]] = {}
        for player, boxes, distance in _reverse_play(floor, targets, num_steps):
            if not boxes & targets:
                by_distance.setdefault(distance, []).append((player, boxes))
        if by_distance:
            # Distance first, then a state: far states outnumber near ones, and would crowd them out.
            player, boxes = rng.choice(by_distance[rng.choice(sorted(by_distance))])
            return Level(height, width, floor, targets, player, boxes)
    # Only reachable with a room too small or too few steps to move every box off its target.
    raise ValueError(
        f"no level with {num_boxes} box(es) in {height}x{width} after {max_tries} tries; "
        "increase dim_room or num_steps"
    )


@register("sokoban")
class Sokoban:
    system_prompt = (
        "You are playing Sokoban: push every box onto a target. # wall, _ floor, "
        "O target, X box, √ box on target, P you, S you on a target. You push a box by "
        "walking into it. Moves: Up, Down, Left, Right. "
        "Answer like <answer>Up || Left</answer>."
    )

    def __init__(
        self,
        dim_room: tuple[int, int] | list[int] = (6, 6),
        num_boxes: int = 1,
        num_steps: int = 8,
        max_actions_per_turn: int = 3,
        step_penalty: float = -0.1,
        box_on_target_reward: float = 1.0,
        box_off_target_penalty: float = -1.0,
        finish_reward: float = 10.0,
        format_penalty: float = -0.1,
    ) -> None:
        if (
            not isinstance(dim_room, (tuple, list))
            or len(dim_room) != 2
            or not all(isinstance(d, int) and 5 <= d <= 10 for d in dim_room)
        ):
            raise ValueError(f"dim_room must be two integers in [5, 10], got {dim_room!r}")
        # The bounds keep the reverse-play search of a reset within ~25 ms (10x10, 3 boxes, 20).
        if not isinstance(num_boxes, int) or not 1 <= num_boxes <= 3:
            raise ValueError(f"num_boxes must be an integer in [1, 3], got {num_boxes!r}")
        if not isinstance(num_steps, int) or not 1 <= num_steps <= 20:
            raise ValueError(f"num_steps must be an integer in [1, 20], got {num_steps!r}")
        if not isinstance(max_actions_per_turn, int) or max_actions_per_turn < 1:
            raise ValueError(f"max_actions_per_turn must be an integer >= 1, got {max_actions_per_turn!r}")
        self.height, self.width = dim_room
        self.num_boxes, self.num_steps = num_boxes, num_steps
        self.max_actions_per_turn = max_actions_per_turn
        self.step_penalty, self.box_on_target_reward = step_penalty, box_on_target_reward
        self.box_off_target_penalty, self.finish_reward = box_off_target_penalty, finish_reward
        self.format_penalty = format_penalty
        if max_actions_per_turn == 1:
            self.system_prompt = self.system_prompt.replace("Up || Left", "Up")
        try:  # a room too small for the boxes would otherwise fail at every reset
            generate_level(random.Random(0), self.height, self.width, num_boxes, num_steps)
        except ValueError:
            raise ValueError(
                f"dim_room={dim_room!r} has no level with num_boxes={num_boxes} and num_steps={num_steps}"
            ) from None
        self.level: Level | None = None
        self.player: Cell = (0, 0)
        self.boxes: set[Cell] = set()
        self._done = True

    async def reset(self, seed: int) -> Observation:
        rng = random.Random(seed)
        self.level = generate_level(rng, self.height, self.width, self.num_boxes, self.num_steps)
        self.player, self.boxes = self.level.player, set(self.level.boxes)
        self._done = False
        return self._observe()

    async def step(self, action: str) -> StepResult:
        if self._done or self.level is None:
            raise RuntimeError("step() after the episode ended; call reset() first")
        moves = parse_moves(action, MOVES, self.max_actions_per_turn)
        if moves is None:
            obs = self._observe("Invalid answer; use Up, Down, Left or Right.\n")
            return StepResult(obs, self.format_penalty, False, {"valid": False, "success": False})
        reward, executed = 0.0, 0
        for move in moves:
            executed += 1
            reward += self._push(move)
            if self._done:
                break
        info = {
            "valid": True,
            "success": self._done,
            "actions_executed": executed,
            "boxes_on_target": len(self.boxes & self.level.targets),
        }
        # Rounded so that sums of -0.1 compare as the decimals they stand for.
        return StepResult(self._observe(), round(reward, 6), self._done, info)

    def _push(self, move: str) -> float:
        """Apply one move; its gym-sokoban reward."""
        assert self.level is not None
        targets = self.level.targets
        on_before = len(self.boxes & targets)
        dr, dc = MOVES[move]
        nxt = (self.player[0] + dr, self.player[1] + dc)
        if nxt in self.boxes:
            beyond = (nxt[0] + dr, nxt[1] + dc)
            if beyond in self.level.floor and beyond not in self.boxes:
                self.boxes.remove(nxt)
                self.boxes.add(beyond)
                self.player = nxt
        elif nxt in self.level.floor:
            self.player = nxt
        on_after = len(self.boxes & targets)
        reward = self.step_penalty
        if on_after > on_before:
            reward += self.box_on_target_reward
        elif on_after < on_before:
            reward += self.box_off_target_penalty
        if on_after == len(targets):
            reward += self.finish_reward
            self._done = True
        return reward

    def render(self) -> str:
        assert self.level is not None
        rows = []
        for r in range(self.level.height):
            row = []
            for c in range(self.level.width):
                cell, on_target = (r, c), (r, c) in self.level.targets
                if cell == self.player:
                    row.append("S" if on_target else "P")
                elif cell in self.boxes:
                    row.append("√" if on_target else "X")
                elif on_target:
                    row.append("O")
                else:
                    row.append("_" if cell in self.level.floor else "#")
            rows.append(" ".join(row))
        return "\n".join(rows)

    def anchor(self) -> str:
        boxes = ";".join(f"{r},{c}" for r, c in sorted(self.boxes))
        return f"{self.player[0]},{self.player[1]}|{boxes}"

    def _observe(self, prefix: str = "") -> Observation:
        return Observation(prefix + self.render(), anchor=self.anchor())
