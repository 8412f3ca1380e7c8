"""How episodes are scored and evaluated.

rewards.py    reward functions of the `dataset` environment (math answers and more)
judge.py      an LLM judge as the reward: a frozen model grades each finished episode
evaluator.py  evaluation rounds during training: scored, reported, never trained on
"""
