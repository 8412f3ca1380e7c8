"""`millstream debug`: one episode under a GDB-like prompt.

engine.py   the episode turn by turn under the user's hand (breakpoints, edits, back)
repl.py     the prompt's commands
replay.py   recorded episodes replayed against two policies, and where they part
actor.py    an actor on a checkpoint's weights, started and stopped with the session
"""
