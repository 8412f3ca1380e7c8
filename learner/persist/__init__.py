"""What the learner writes to disk.

checkpoint.py  resumable checkpoints: the policy, its optimizer, the replay buffer, RNGs
hfexport.py    the policy as a Hugging Face model directory transformers and vLLM load
"""
