"""Does it learn: benchmarks whose measure is a reward or an accuracy, not a speed.

margins.py      a learner's reward rise against a non-learner's drift, at a learning test's
                settings (where the test's bar goes)
real_model.py   SmolLM2-135M-Instruct's held-out accuracy before and after a run, per seed and
                variant (full, LoRA), with the step time split and memory
"""
