"""FrozenLake as in RAGEN (after gym's FrozenLake-v1): walk across the ice to the goal.

The lake is a `size` x `size` grid (default 4). The seed draws a start and a goal cell (distinct,
anywhere on the grid, as RAGEN's `generate_random_map` does, where gym fixes them to the
corners) and makes every other cell a hole with probability `hole_prob` (default 0.2, gym's
`p=0.8` frozen); a lake with no path from start to goal is drawn again from the same generator,
so every lake is solvable and the same seed always gives the same lake.

Moves are Left, Down, Right, Up (case-insensitive), several per turn separated by "||" as in
RAGEN: `<answer>Down || Right</answer>`, at most `max_actions_per_turn` (default 3, so the
default 4 turns allow 12 moves: enough for any 4x4 lake). A move off the grid leaves the player
in place (gym). Reaching the goal pays 1 and ends the episode (success); stepping into a hole
pays 0 and ends it; the moves after the one that ends the episode are ignored. An answer that is
missing, names an unknown move or has too many moves is invalid as a whole: `format_penalty`
(default -0.1), `valid=False`, nothing moves.

With `slippery=True` each move goes the intended way with probability 1/3 and to either
perpendicular side otherwise (gym's rule). The slips come from the episode's generator, the k-th
move of an episode using the k-th draw, so every episode of a group meets the same luck.

Observation: the grid, one row a line, cells separated by spaces: P player, _ ice, O hole,
G goal, X player in a hole, √ player on the goal (RAGEN's symbols). Anchor: the player's cell,
"row,col" (the lake itself is fixed by the seed the whole group shares).
"""

from __future__ import annotations

import random
from collections import deque

from millstream.envpool.envs.base import Observation, StepResult, parse_moves, register

__all__ = ["FrozenLake", "generate_lake", "MOVES"]

#: Gym's action order; slipping turns a move into its neighbours in this order (perpendiculars).
MOVES: dict[str, tuple[int, int]] = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
_ORDER = list(MOVES)

Cell = tuple[int, int]


def _has_path(size: int, holes: frozenset[Cell], start: Cell, goal: Cell) -> bool:
    seen, todo = {start}, deque([start])
    while todo:
        r, c = todo.popleft()
        if (r, c) == goal:
            return True
        for dr, dc in MOVES.values():
            nxt = (r + dr, c + dc)
            if 0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in holes and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


def generate_lake(size: int, hole_prob: float, rng: random.Random) -> tuple[frozenset[Cell], Cell, Cell]:
    """(holes, start, goal) of a lake with a path from start to goal; redraws until it has one."""
    cells = [(r, c) for r in range(size) for c in range(size)]
    while True:
        start, goal = rng.sample(cells, 2)
        # One draw per cell, start and goal included, so the stream does not depend on where they are.
        holes = frozenset(cell for cell in cells if rng.random() < hole_prob and cell not in (start, goal))
        if _has_path(size, holes, start, goal):
            return holes, start, goal


@register("frozenlake")
class FrozenLake:
    system_prompt = (
        "You walk on a frozen lake: P is you, _ is ice, O is a hole, G is the goal. "
        "Reach G without falling into a hole. Moves: Left, Down, Right, Up. "
        "Answer like <answer>Down || Right</answer>."
    )

    def __init__(
        self,
        size: int = 4,
        hole_prob: float = 0.2,
        slippery: bool = False,
        max_actions_per_turn: int = 3,
        format_penalty: float = -0.1,
    ) -> None:
        if not isinstance(size, int) or not 2 <= size <= 10:
            raise ValueError(f"size must be an integer in [2, 10], got {size!r}")
        # Above ~0.5 most lakes have no path and generation would spin on redraws.
        if not 0.0 <= hole_prob <= 0.5:
            raise ValueError(f"hole_prob must be in [0, 0.5], got {hole_prob!r}")
        if not isinstance(max_actions_per_turn, int) or max_actions_per_turn < 1:
            raise ValueError(f"max_actions_per_turn must be an integer >= 1, got {max_actions_per_turn!r}")
        self.size, self.hole_prob, self.slippery = size, hole_prob, bool(slippery)
        self.max_actions_per_turn = max_actions_per_turn
        self.format_penalty = format_penalty
        if max_actions_per_turn == 1:
            self.system_prompt = self.system_prompt.replace("Down || Right", "Down")
        self._rng = random.Random(0)
        self.holes: frozenset[Cell] = frozenset()
        self.start: Cell = (0, 0)
        self.goal: Cell = (0, 0)
        self.player: Cell = (0, 0)
        self._done = True

    async def reset(self, seed: int) -> Observation:
        self._rng = random.Random(seed)
        self.holes, self.start, self.goal = generate_lake(self.size, self.hole_prob, self._rng)
        self.player = self.start
        self._done = False
        return self._observe()

    async def step(self, action: str) -> StepResult:
        if self._done:
            raise RuntimeError("step() after the episode ended; call reset() first")
        moves = parse_moves(action, MOVES, self.max_actions_per_turn)
        if moves is None:
            obs = self._observe("Invalid answer; use Left, Down, Right or Up.\n")
            return StepResult(obs, self.format_penalty, False, {"valid": False, "success": False})
        reward, executed = 0.0, 0
        for move in moves:
            executed += 1
            self.player = self._move(self.player, self._slip(move))
            if self.player == self.goal:
                reward, self._done = 1.0, True
            elif self.player in self.holes:
                self._done = True
            if self._done:
                break
        info = {"valid": True, "success": self.player == self.goal, "actions_executed": executed}
        return StepResult(self._observe(), reward, self._done, info)

    def _slip(self, move: str) -> str:
        if not self.slippery:
            return move
        i = _ORDER.index(move)
        return _ORDER[(i + self._rng.choice((-1, 0, 1))) % 4]

    def _move(self, cell: Cell, move: str) -> Cell:
        dr, dc = MOVES[move]
        r, c = cell[0] + dr, cell[1] + dc
        return (r, c) if 0 <= r < self.size and 0 <= c < self.size else cell

    def render(self) -> str:
        rows = []
        for r in range(self.size):
            row = []
            for c in range(self.size):
                cell = (r, c)
                if cell == self.player:
                    row.append("√" if cell == self.goal else "X" if cell in self.holes else "P")
                else:
                    row.append("G" if cell == self.goal else "O" if cell in self.holes else "_")
            rows.append(" ".join(row))
        return "\n".join(rows)

    def _observe(self, prefix: str = "") -> Observation:
        return Observation(prefix + self.render(), anchor=f"{self.player[0]},{self.player[1]}")
