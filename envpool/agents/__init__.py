"""Agent environments: an agent of its own talks to an OpenAI-compatible endpoint per episode.

endpoint.py   the endpoint (`/v1/chat/completions`, `/v1/completions`), recording tokens
episode.py    one agent episode: run the agent, build the trajectory its calls recorded
toolcalls.py  tool calls in generated text -> OpenAI `tool_calls`
"""
