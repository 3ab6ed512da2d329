"""The rest of verl's key table: keys of verl's full generated config that its run scripts rarely set.

They are profilers, monitoring, Hydra class paths, engine and server internals, verl's copies of other keys,
and the settings of features hybridflow lacks. hybridflow/compat/verl/keys.py merges these tables into its
own (a key may be in only one of the two modules) and is the one place the dialect and docs/verl.md read.

Where a feature hybridflow lacks has one switch, the switch is in `NOT_YET` (refused unless it leaves the
feature off) and the settings under it are in `NO_EFFECT` (they do nothing while the switch is off), so verl's
own defaults load. `ACCEPTED` names, for a `NOT_YET` key, the values that are what hybridflow does anyway.
"""

from __future__ import annotations

from typing import Any

A = "actor_rollout_ref"
PROFILED = (f"{A}.actor", f"{A}.ref", f"{A}.rollout", "critic", "reward_model")
"""verl sections with a `profiler` subtree."""
TRAINED = (f"{A}.actor", "critic")
"""verl sections with an `optim` subtree (the critic's is `critic.optim`)."""
FSDP = {
    f"{A}.actor.fsdp_config": "actor.engine",
    f"{A}.ref.fsdp_config": "ref",
    "critic.model.fsdp_config": "critic.engine",
}
"""verl's engine config of a role -> the hybridflow section that holds its compute dtype."""

_PROFILER = (
    "verl's profilers (nsys, npu, torch, torch_memory) are not in hybridflow: every step logs timing_s/* "
    "and memory/peak_gb/* per operator instead"
)
_COPY = "verl's copy of actor_rollout_ref.rollout.n, which hybridflow reads (as rollout.n)"
_GLOBAL_MICRO = "micro-batch size for all devices together (verl's deprecated key: use {}_per_gpu)"
_SETTING_OF = "a setting of {}, which hybridflow lacks ({} is refused unless off)"
_SEED = (
    "hybridflow's engines take no seed: LoRA adapters and value heads start from "
    "fixed seeds; data.seed, rollout.seed and the step number seed the shuffles and the sampling"
)

NO_EFFECT: dict[str, str] = {
    "*._target_": "a Hydra class path of verl's config: hybridflow's sections are its own dataclasses",
    "global_profiler.*": _PROFILER,
    "ray_kwargs.timeline_json_file": "a Ray timeline dump for profiling: hybridflow logs timing_s/* per operator",
    f"{A}.actor.rollout_n": _COPY,
    f"{A}.ref.rollout_n": _COPY,
    "critic.rollout_n": _COPY,
    f"{A}.rollout.mtp.*": f"verl's copy of {A}.model.mtp for the rollout: multi-token prediction, which hybridflow "
    f"lacks ({A}.model.mtp.enable is refused unless off)",
    "data.tool_config_path": "verl's copy of the multi-turn tool config, for the dataset's prompts: hybridflow's "
    "tool environment takes each row's tools (rollout.multi_turn.env); verl's tool-config file format differs",
    f"{A}.actor.use_fused_kernels": "a CUDA kernel option: hybridflow's CPU path has no such kernel "
    "(fused log-prob/entropy)",
    "reward_model.model.use_fused_kernels": "a CUDA kernel option: hybridflow's CPU path has no such kernel",
    f"{A}.actor.sum_pi_squared_checkpointing": "GPU memory saving for the sum-of-squared-probabilities metric, "
    "which hybridflow does not compute",
    f"{A}.ref.entropy_from_logits_with_chunking": "hybridflow always chunks logits (engine.logits_chunk_size)",
    f"{A}.ref.entropy_checkpointing": "GPU memory saving for the entropy: logits are chunked here",
    f"{A}.ref.ulysses_sequence_parallel_size": "the reference runs with the actor's engine layout here "
    "(actor.engine.ulysses_sequence_parallel_size)",
    f"{A}.ref.fsdp_config.ulysses_sequence_parallel_size": "the reference runs with the actor's engine layout here "
    "(actor.engine.ulysses_sequence_parallel_size)",
    f"{A}.ref.fsdp_config.fsdp_size": "the reference is forward-only: its FSDP layout changes memory and speed, "
    "not log-probs; hybridflow picks it per device",
    f"{A}.ref.fsdp_config.reshard_after_forward": "the reference is forward-only: its FSDP layout changes memory "
    "and speed, not log-probs; hybridflow picks it per device",
    "reward_model.model.fsdp_config.fsdp_size": "the reward model is forward-only: its FSDP layout changes memory "
    "and speed, not scores; hybridflow picks it per device",
    "reward_model.model.fsdp_config.reshard_after_forward": "the reward model is forward-only: its FSDP layout "
    "changes memory and speed, not scores; hybridflow picks it per device",
    "reward_model.model.use_remove_padding": "the reward model always drops padding columns here (same scores)",
    "reward_model.model.use_shm": "copying the model through /dev/shm: models load from a local directory here",
    "critic.model.use_shm": "copying the model through /dev/shm: models load from a local directory here",
    # GPU serving and weight transfer
    f"{A}.rollout.scheduling_policy": "the request scheduling policy of verl's vLLM server: hybridflow's rollout "
    "decodes a batch at once",
    f"{A}.rollout.checkpoint_engine.update_weights_bucket_megabytes": "the bucket size of verl's GPU weight "
    "transfer to its inference server: hybridflow syncs the rollout's weights its own way (rollout/bridge.py)",
    f"{A}.rollout.prometheus.*": "Prometheus metrics of verl's inference servers: hybridflow logs through "
    "trainer.logger",
    f"{A}.rollout.trace.*": "traces of agent-loop rollouts to weave/mlflow, for monitoring: hybridflow records "
    "no traces (training is the same)",
    # settings of features whose switch is refused
    f"{A}.model.mtp.*": _SETTING_OF.format("multi-token prediction", f"{A}.model.mtp.enable"),
    f"{A}.model.tiled_mlp.num_shards": _SETTING_OF.format("tiled MLP", f"{A}.model.tiled_mlp.enabled"),
    "critic.model.tiled_mlp.num_shards": _SETTING_OF.format("tiled MLP", "critic.model.tiled_mlp.enabled"),
    "critic.model.lora_alpha": _SETTING_OF.format("a LoRA critic", "critic.model.lora_rank"),
    "critic.model.target_modules": _SETTING_OF.format("a LoRA critic", "critic.model.lora_rank"),
    f"{A}.rollout.skip_dump_dir": _SETTING_OF.format("dumping and replaying rollouts", f"{A}.rollout.skip_rollout"),
    "reward_model.forward_max_token_len_per_gpu": _SETTING_OF.format(
        "token-budget micro-batches for the reward model", "reward_model.use_dynamic_bsz"
    ),
    f"{A}.rollout.agent.num_workers": "the number of verl's agent-loop server processes: hybridflow's rollout "
    "runs inside the actor workers",
    "data.image_patch_size": _SETTING_OF.format("vision-language data", "data.image_key"),
    "data.return_multi_modal_inputs": _SETTING_OF.format("vision-language data", "data.image_key"),
    "reward_model.n_gpus_per_node": _SETTING_OF.format(
        "a resource pool of the reward model's own", "reward_model.enable_resource_pool"
    ),
    "reward_model.nnodes": _SETTING_OF.format(
        "a resource pool of the reward model's own", "reward_model.enable_resource_pool"
    ),
    "reward_model.rollout.*": "a vLLM / SGLang engine knob of verl's reward-model server with no counterpart in "
    "hybridflow's judge rollout (judge.rollout.*: its name, lengths, dtype, sampling, max_num_seqs are mapped)",
    "reward_model.sandbox_fusion.*": _SETTING_OF.format(
        "sandbox-fusion code execution rewards", "reward_model.sandbox_fusion.url"
    ),
    "algorithm.pf_ppo.*": _SETTING_OF.format("policy-filtration PPO", "algorithm.use_pf_ppo"),
    "reward_manager.module.name": _SETTING_OF.format("reward managers from a module", "reward_manager.module.path"),
    "algorithm.rollout_correction.rollout_rs_threshold": _SETTING_OF.format(
        "rejection sampling of mismatched rollouts", "algorithm.rollout_correction.rollout_rs"
    ),
    "algorithm.rollout_correction.loss_type": _SETTING_OF.format(
        "the bypass mode of rollout correction", "algorithm.rollout_correction.bypass_mode"
    ),
    "reward_model.use_reward_loop": "verl's reward-loop implementation of scoring: hybridflow scores with its own "
    "reward manager (reward.num_workers), with the same reward functions",
}
for _role in PROFILED:
    NO_EFFECT[f"{_role}.profiler.*"] = _PROFILER
for _fsdp in FSDP:
    NO_EFFECT[f"{_fsdp}.seed"] = _SEED
    NO_EFFECT[f"{_fsdp}.forward_only"] = (
        "set by verl per role (the reference is forward-only); hybridflow's roles know it"
    )
    NO_EFFECT[f"{_fsdp}.entropy_from_logits_with_chunking"] = (
        "hybridflow always chunks logits (engine.logits_chunk_size)"
    )
    NO_EFFECT[f"{_fsdp}.entropy_checkpointing"] = "GPU memory saving for the entropy: logits are chunked here"

NOT_YET: dict[str, str] = {
    f"{A}.model.hf_config_path": "HF config read from another directory than the model's",
    f"{A}.model.mtp.enable": "multi-token prediction (MTP)",
    f"{A}.model.mtp.enable_train": "multi-token prediction (MTP)",
    f"{A}.model.mtp.enable_rollout": "multi-token prediction (MTP)",
    f"{A}.model.tiled_mlp.enabled": "tiled MLP",
    "critic.model.tiled_mlp.enabled": "tiled MLP",
    f"{A}.actor.router_replay.*": "MoE router replay",
    f"{A}.ref.router_replay.*": "MoE router replay",
    f"{A}.rollout.enable_rollout_routing_replay": "MoE router replay",
    f"{A}.rollout.quantization": "quantized rollout",
    f"{A}.rollout.quantization_config_file": "quantized rollout",
    f"{A}.rollout.checkpoint_engine.*": "verl's checkpoint engines for weight sync (nccl, nixl, hccl)",
    f"{A}.actor.ppo_micro_batch_size": _GLOBAL_MICRO.format("ppo_micro_batch_size"),
    f"{A}.ref.log_prob_micro_batch_size": _GLOBAL_MICRO.format("log_prob_micro_batch_size"),
    f"{A}.rollout.log_prob_micro_batch_size": _GLOBAL_MICRO.format("log_prob_micro_batch_size"),
    "critic.ppo_micro_batch_size": _GLOBAL_MICRO.format("ppo_micro_batch_size"),
    "critic.forward_micro_batch_size": "separate compute_values micro-batch (it is ppo_micro_batch_size)",
    "reward_model.micro_batch_size": _GLOBAL_MICRO.format("micro_batch_size"),
    "critic.model.external_lib": "importing a model library by name (user code goes in trainer.plugins)",
    "reward_model.model.external_lib": "importing a model library by name (user code goes in trainer.plugins)",
    "critic.model.trust_remote_code": "models with custom code (trust_remote_code)",
    "reward_model.model.trust_remote_code": "models with custom code (trust_remote_code)",
    "data.trust_remote_code": "models with custom code (trust_remote_code)",
    "reward_model.model.override_config": "overriding the model's HF config",
    "critic.shuffle": "shuffling the critic's mini-batches (hybridflow's critic keeps the batch order)",
    "critic.data_loader_seed": "separate mini-batch shuffle seed (the step seeds it)",
    "critic.checkpoint.*": "choosing what a checkpoint holds (hybridflow always saves model, optimizer and "
    "extra: the LR schedule and rng)",
    "data.validation_shuffle": "shuffling the validation set",
    "reward_manager.name": "reward managers other than verl's naive one (the one hybridflow has)",
    "reward_manager.source": "reward managers from a module",
    "reward_manager.module.path": "reward managers from a module",
    "reward_model.enable_resource_pool": "resource pool of the reward model's own",
    "reward_model.max_length": "truncating the reward model's inputs",
    "reward_model.use_dynamic_bsz": "token-budget micro-batches for the reward model",
    "reward_model.reward_loop_source": "custom reward-loop classes",
    "reward_model.reward_loop_module_path": "custom reward-loop classes",
    "reward_model.reward_loop_class_name": "custom reward-loop classes",
    "algorithm.rollout_correction.bypass_mode": "the bypass mode of rollout correction (the rollout's log-probs "
    "as old log-probs)",
    "algorithm.rollout_correction.rollout_is_batch_normalize": "normalizing rollout IS weights to mean 1 per batch",
    "transfer_queue.enable": "verl's TransferQueue data plane",
    "ray_kwargs.ray_init.num_cpus": "capping Ray's CPUs at ray.init (trainer.cpus_per_worker sizes each worker)",
}
for _fsdp in FSDP:
    NOT_YET[f"{_fsdp}.model_dtype"] = "master weights in another dtype than fp32"
    NOT_YET[f"{_fsdp}.full_determinism"] = "verl's full-determinism mode"
for _role in TRAINED:
    NOT_YET[f"{_role}.optim.optimizer"] = "optimizers other than AdamW"
    NOT_YET[f"{_role}.optim.optimizer_impl"] = "optimizer libraries other than torch.optim"
    NOT_YET[f"{_role}.optim.num_cycles"] = "cosine schedules other than half a cycle"
    NOT_YET[f"{_role}.optim.override_optimizer_config"] = "extra optimizer arguments"

ACCEPTED: dict[str, tuple[Any, ...]] = {
    f"{A}.actor.router_replay.mode": ("disabled",),
    f"{A}.ref.router_replay.mode": ("disabled",),
    f"{A}.rollout.checkpoint_engine.backend": ("naive",),
    "reward_manager.name": ("naive",),
    "reward_manager.source": ("register",),
    "reward_model.reward_loop_source": ("register",),
    "critic.data_loader_seed": (42,),  # verl's default: seeds only a shuffle, which hybridflow's critic does not do
    "critic.checkpoint.save_contents": (["model", "optimizer", "extra"],),
    "critic.checkpoint.load_contents": (["model", "optimizer", "extra"],),
}
"""Values of a `NOT_YET` key that are what hybridflow does (besides the values that leave a feature off)."""
for _fsdp in FSDP:
    ACCEPTED[f"{_fsdp}.model_dtype"] = ("fp32", "float32")
for _role in TRAINED:
    ACCEPTED[f"{_role}.optim.optimizer"] = ("AdamW",)
    ACCEPTED[f"{_role}.optim.optimizer_impl"] = ("torch.optim",)
    ACCEPTED[f"{_role}.optim.num_cycles"] = (0.5,)
