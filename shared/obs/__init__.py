"""What a run tells people while it runs.

metrics.py     metrics as JSON lines, namespaced keys (`reward/mean`, `sync/total_s`)
dashboards.py  the learner's metrics to `metrics.jsonl` and to TensorBoard / W&B
ratelog.py     counted, rate-limited logging of bad input
"""
