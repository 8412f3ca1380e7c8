"""The loop's own checks: evenchars (dense and learnable), echo (transport stress), noop (the
envpool's own cost), flaky (wraps any environment and injects faults)."""
