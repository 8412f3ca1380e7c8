"""What the learner writes to disk.

checkpoint.py   resumable checkpoints: the policy, its optimizer, the replay buffer, RNGs
replaystate.py  the replay buffer's part of a checkpoint, as plain data
hfexport.py     the policy as a Hugging Face model directory transformers and vLLM load
"""
