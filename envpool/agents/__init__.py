"""Agent environments: an agent of its own talks to an OpenAI-compatible endpoint per episode.

endpoint.py   the endpoint (`/v1/chat/completions`, `/v1/completions`), recording tokens
requests.py   what a request asks for: each field honoured, neutral only, or refused
messages.py   messages as chat templates take them (content, arguments, roles)
splice.py     one sequence per episode: a reply sent back becomes its sampled tokens
toolformats.py each family's tool-call format (vLLM's parser names)
responses.py  what a generation becomes: stop strings, logprobs, envelopes, streams
episode.py    one agent episode: run the agent, build the trajectory its calls recorded
toolcalls.py  tool calls in generated text -> OpenAI `tool_calls`; forced calls
"""
