"""Agent environments: the contract (agent.py: an agent of its own talks to an OpenAI-compatible
endpoint per episode) and openai_agent, written only against the official `openai` client."""
