"""Text tasks: a data set of prompts and answers scored by a reward function (dataset), Delethink's
bounded chunks (markovian), and an AgentFlow planner among untrained turns (agentflow)."""
