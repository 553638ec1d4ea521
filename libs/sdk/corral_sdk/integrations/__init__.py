"""Adapters that let code written against other agent tooling drive corral unchanged: a SWE-ReX
deployment (`swerex.py`, extra `swerex`), a Gymnasium interface (`gym.py`, extra `rl`) and an MCP
server (`mcp_server.py`, extra `mcp`) whose tools (`tools.py`) also export as OpenAI function
schemas. Each imports its package lazily, so the
base SDK never needs them."""
