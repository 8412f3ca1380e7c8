"""Games with rules and a reward per move: RAGEN's bandit, frozenlake and sokoban; TinyZero's
countdown; guessnumber. Each module's docstring is its rules."""
