"""Every DataProto key the trainer and the workers exchange, declared once.

Shapes use B = batch (one row per sampled response), P = max prompt length,
R = max response length, T = P + R. Prompts are LEFT-padded, responses are
RIGHT-padded, so `input_ids = cat([prompts, responses], dim=-1)` and the
last prompt token always sits at column P - 1. Per-token quantities that
belong to the response (log-probs, values, rewards, advantages) have shape
[B, R] and line up with `responses`; `response_mask` marks their valid entries.

Import the names, not the strings, so a typo fails at import time.
"""

# --- tensors in DataProto.batch ---------------------------------------------
INPUT_IDS = "input_ids"  # [B, T] int64: prompt + response token ids
ATTENTION_MASK = "attention_mask"  # [B, T] int64: 1 on real tokens, 0 on padding
POSITION_IDS = "position_ids"  # [B, T] int64: cumsum(attention_mask) - 1, clipped at 0
PROMPTS = "prompts"  # [B, P] int64: left-padded prompt ids
RESPONSES = "responses"  # [B, R] int64: right-padded response ids
RESPONSE_MASK = "response_mask"  # [B, R] int64/float: 1 on generated tokens up to and incl. EOS; 0 on padding and
# (multi-turn) on observation tokens, which attention_mask marks 1: trained tokens are response_mask, real ones attention_mask
ROLLOUT_LOG_PROBS = "rollout_log_probs"  # [B, R] float32: log-probs the sampler drew with
OLD_LOG_PROBS = "old_log_probs"  # [B, R] float32: actor log-probs before the update
ENTROPYS = "entropys"  # [B, R] float32: per-token entropy of the actor
REF_LOG_PROB = "ref_log_prob"  # [B, R] float32: reference-policy log-probs
TEACHER_LOG_PROBS = "teacher_log_probs"  # [B, R] float32: the distillation teacher's log-probs of the sampled tokens
VALUES = "values"  # [B, R] float32: critic values V(s_t)
RM_SCORES = "rm_scores"  # [B, R] float32: reward-model score at the last valid token, 0 elsewhere
TOKEN_LEVEL_SCORES = "token_level_scores"  # [B, R] float32: task score at the last valid token
TOKEN_LEVEL_REWARDS = "token_level_rewards"  # [B, R] float32: scores minus KL penalty (if in reward)
REWARD_BASELINES = "reward_baselines"  # [B] float32: ReMax's greedy-response score of the row's prompt
ADVANTAGES = "advantages"  # [B, R] float32
RETURNS = "returns"  # [B, R] float32: value targets
ROLLOUT_IS_WEIGHTS = "rollout_is_weights"  # [B, R] float32: pi_old / pi_rollout, bounded (algorithm.rollout_is)
ENV_REWARDS = (
    "env_rewards"  # [B, R] float32: multi-turn rollouts: each model turn's environment reward on its last token
)
SAMPLED_IDS_HASH = "sampled_ids_hash"  # [B] int64: hybridflow/protocol/token_hash.py's hash of the ids the sampler drew
# (in order, over the tokens response_mask marks), taken where they were sampled; checked before the update against
# the response columns of input_ids (what the update reads)
POLICY_VERSION = (
    "policy_version"  # [B] int64: trainer step whose weights generated the row (0: initial weights; the oldest of its
)
# tokens' where a partial rollout switched weights mid-row)
TOKEN_POLICY_VERSION = "token_policy_version"  # [B, R] int64: the policy version (trainer step) whose weights sampled
# each response token; -1 where response_mask is 0 (observations, padding). A partial rollout (trainer.partial_rollout)
# switches weights mid-row, so one row may hold several versions; the staleness metrics and the parity guard read it

# --- numpy object arrays in DataProto.non_tensor_batch ----------------------
UID = "uid"  # [B] str: one id per prompt; the n samples of a prompt share it (GRPO groups)
DATA_SOURCE = "data_source"  # [B] str: which scorer applies ("arithmetic", "gsm8k", ...)
GROUND_TRUTH = "ground_truth"  # [B] str: reward_model.ground_truth of the dataset row
RAW_PROMPT = "raw_prompt"  # [B] list[dict]: the chat messages before templating
EXTRA_INFO = "extra_info"  # [B] dict: the dataset row's extra_info
NUM_TURNS = "num_turns"  # [B] int: multi-turn rollouts: model turns of the trajectory
TOOL_CALLS = "tool_calls"  # [B] int: multi-turn rollouts: tool calls the trajectory made
STOP_REASON = "stop_reason"  # [B] str: multi-turn rollouts: why it stopped (hybridflow/agent/loop/runner.py)
HARNESS_STATUS = "harness_status"  # [B] str: rollout.agent: how its harness call ended (endpoint/harness_batch.py)

# --- meta_info keys ----------------------------------------------------------
# meta_info carries what a batch IS, never what a worker should DO: control flags (sampling params,
# n, validate, temperature, own_old_log_prob, the step to reseed from) are typed arguments of the
# worker methods (workers/actor_rollout_ref.py). Only these three keys remain:
META_GLOBAL_STEP = "global_step"
"""int: the training step whose batch (or prompts) this is, stamped by the controller (the PPO rollout
source, train/async_pipeline.py; the SFT trainer). Provenance, not a flag: no worker branches on it (generate_sequences
takes `step` as an argument); the tests' fault injection (tests/faults/) keys on it, and the ReMax
baseline regenerates a batch's prompts with the step they carry."""
META_METRICS = "metrics"
"""dict[str, float | list[float]]: metrics returned by a worker call. Valid-token counts for
throughput are derived from attention_mask on the controller (train/metrics.py), not sent."""
META_PARITY = "parity_findings"
"""list[str]: what a worker's parity checks found wrong in this call (hybridflow/parity/), one line per finding,
e.g. a weight sync whose fingerprints differ; empty or absent when all is well. Concatenated across the parts of a
collected output; the controller's guard turns findings into an error or a warning (trainer.parity)."""
