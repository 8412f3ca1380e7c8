"""Tool use: Python run in a sandboxed subprocess (pytool, with sandbox/) and Search-R1's retrieval
game over a shipped offline corpus (search)."""
