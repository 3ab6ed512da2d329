"""Agentic RL: environments, tools (with a process sandbox), tool-call parsing and the multi-turn loop.

- `env.py`: the `Environment` users write (`reset(row)`, `step(text)`), the `ENVIRONMENTS`
  registry and the built-in `ToolEnvironment` ("tool").
- `tool_calls.py`: the `<tool_call>{json}</tool_call>` format and chat-template rendering.
- `tools/`: the `Tool` interface, the `TOOLS` registry, `calculator`, `python` (sandboxed).
- `tokens.py`: prompt and observation token ids from the chat template (tokenized once).
- `loop.py`: `run_agent_loop`, the token-exact multi-turn loop over a batched turn generator.
- `batch.py`: trajectories -> DataProto in the rollout layout of hybridflow/keys.py.
- `rollout_loop.py`: the loop inside the rollout worker (rollout.multi_turn): prompt rows -> trajectories
  over the worker's rollout, one generate call per round.
- `server.py`: the OpenAI-compatible HTTP server (`hybridflow serve`) that records every sampled
  token per session; `openai_format.py` (request/response shapes), `sessions.py` (token capture),
  `backend.py` (the generation backend and the request batcher), `rollout_backend.py` (a Rollout as one).
- `harness.py`: training a plain openai-client harness (rollout.agent): the endpoint over the rollout worker's
  own rollout, the harness calls; `harness_batch.py` (their sessions -> the batch); `examples/` (harnesses).
"""
