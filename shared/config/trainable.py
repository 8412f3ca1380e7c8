"""What sampling the learner can train on: the actor's distribution must be the learner's policy.

The learner's policy is softmax(logits / `envpool.temperature`) over the whole vocabulary
(learner/train/loss.py), and the actor's logprobs are that distribution's (actor/engine.py). The
two are the policy that sampled only when the sampling is exactly that:
- nucleus sampling (`top_p` < 1) draws from a truncated, renormalised distribution, so every
  ratio and importance weight against it would be off, the more so the smaller the nucleus;
- greedy sampling (temperature 0) has no distribution to improve, and every member of a group
  would play alike.

The launcher checks it before a run starts, and the learner again when started on its own.
Roles that only generate (an envpool debugging session, an evaluation) may sample either way.
"""

from __future__ import annotations

from millstream.shared.config.schema import Config

__all__ = ["sampling_problem"]


def sampling_problem(cfg: Config) -> str | None:
    """Why the learner cannot train on `cfg.envpool`'s sampling, in one line, or None."""
    envpool = cfg.envpool
    if envpool.temperature == 0:
        return (
            "envpool.temperature = 0: greedy samples cannot be trained on (every member of a "
            "group plays the same reply); sample with a temperature > 0 (1.0: the model's own "
            "distribution)"
        )
    if envpool.top_p < 1:
        return (
            f"envpool.top_p = {envpool.top_p:g}: the learner trains the distribution at "
            "envpool.temperature over the whole vocabulary, and nucleus sampling draws from a "
            "truncated one, so every ratio and importance weight would be off; use top_p = 1 "
            "(a temperature below 1 sharpens what is sampled, and is trained on exactly)"
        )
    return None
