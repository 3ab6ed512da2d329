"""verl's `ppo_trainer.yaml` key names, and what each one is in hybridflow: the one table of the verl dialect.

`RENAMED` maps a verl key to hybridflow's key for the same setting (same meaning, same units; a few values are
translated, see `VALUES`). `SETS` lists verl keys whose value sets several hybridflow keys. `NO_EFFECT` lists
verl keys accepted and named, with why they do nothing here, in one summary warning. `NOT_YET` lists verl keys
refused with the feature hybridflow lacks; `ACCEPTED` names the values of such a key that are what hybridflow
does anyway (verl's own default among them where hybridflow does the same: verl's generated config sets every
key). `NULL_IS_UNSET` lists verl keys whose null means "not set". A key ending in `.*` stands for every key
under it; `*.leaf` for every key whose last part is `leaf`. verl keys spelled the same in hybridflow (most of `data.*`, `algorithm.*`, `trainer.*`, `critic.*`) are
not listed: they pass unchanged. The keys of verl's full generated config that its scripts rarely set
(profilers, class paths, internals) live in verl_keys_internal.py and are merged into these tables.
`VERL_DEFAULTS` is the base layer a run written with verl's names starts from (hybridflow/compat/verl/dialect.py).
docs/verl.md is generated from this file (`python -m hybridflow.compat.verl.doc > docs/verl.md`;
tests/test_verl_keys.py checks it is in sync).
"""

from __future__ import annotations

from typing import Any

from hybridflow.compat.verl import keys_internal as _internal

A = "actor_rollout_ref"
ROLES = (f"{A}.actor", f"{A}.ref", "critic.model", "reward_model.model")
"""verl sections that carry an `fsdp_config`."""

RENAMED: dict[str, str] = {
    # the policy model
    f"{A}.model.path": "model.path",
    f"{A}.model.tokenizer_path": "model.tokenizer_path",
    f"{A}.model.enable_gradient_checkpointing": "actor.engine.gradient_checkpointing",
    f"{A}.model.use_remove_padding": "actor.engine.use_remove_padding",
    f"{A}.actor.use_remove_padding": "actor.engine.use_remove_padding",
    f"{A}.model.lora_rank": "actor.lora.rank",
    f"{A}.model.lora_alpha": "actor.lora.alpha",
    f"{A}.model.target_modules": "actor.lora.target_modules",
    f"{A}.nccl_timeout": "trainer.collective_timeout_s",
    # the multi-turn agent loop
    f"{A}.rollout.multi_turn.enable": "rollout.multi_turn.enable",
    f"{A}.rollout.multi_turn.max_assistant_turns": "rollout.multi_turn.max_assistant_turns",
    f"{A}.rollout.multi_turn.max_user_turns": "rollout.multi_turn.max_user_turns",
    f"{A}.rollout.multi_turn.max_tool_response_length": "rollout.multi_turn.max_tool_response_length",
    # the actor's update
    f"{A}.actor.ppo_mini_batch_size": "actor.ppo_mini_batch_size",
    f"{A}.actor.ppo_micro_batch_size_per_gpu": "actor.ppo_micro_batch_size_per_device",
    f"{A}.actor.use_dynamic_bsz": "actor.use_dynamic_bsz",
    f"{A}.actor.ppo_max_token_len_per_gpu": "actor.ppo_max_token_len_per_gpu",
    f"{A}.actor.ppo_epochs": "actor.ppo_epochs",
    f"{A}.actor.shuffle": "actor.shuffle",
    f"{A}.actor.loss_agg_mode": "actor.loss_agg_mode",
    f"{A}.actor.entropy_coeff": "actor.entropy_coeff",
    f"{A}.actor.use_kl_loss": "actor.use_kl_loss",
    f"{A}.actor.kl_loss_coef": "actor.kl_loss_coef",
    f"{A}.actor.kl_loss_type": "actor.kl_loss_type",
    f"{A}.actor.grad_clip": "actor.optim.grad_clip",
    f"{A}.actor.clip_ratio": "actor.policy_loss.clip_ratio",
    f"{A}.actor.clip_ratio_low": "actor.policy_loss.clip_ratio_low",
    f"{A}.actor.clip_ratio_high": "actor.policy_loss.clip_ratio_high",
    f"{A}.actor.clip_ratio_c": "actor.policy_loss.clip_ratio_c",
    f"{A}.actor.tau_pos": "actor.policy_loss.sapo_tau_pos",
    f"{A}.actor.tau_neg": "actor.policy_loss.sapo_tau_neg",
    f"{A}.actor.policy_loss.loss_mode": "actor.policy_loss_mode",
    f"{A}.actor.policy_loss.clip_cov_ratio": "actor.policy_loss.clip_cov_ratio",
    f"{A}.actor.policy_loss.clip_cov_lb": "actor.policy_loss.clip_cov_lb",
    f"{A}.actor.policy_loss.clip_cov_ub": "actor.policy_loss.clip_cov_ub",
    f"{A}.actor.policy_loss.kl_cov_ratio": "actor.policy_loss.kl_cov_ratio",
    f"{A}.actor.policy_loss.ppo_kl_coef": "actor.policy_loss.ppo_kl_coef",
    f"{A}.actor.ulysses_sequence_parallel_size": "actor.engine.ulysses_sequence_parallel_size",
    f"{A}.actor.optim.lr": "actor.optim.lr",
    f"{A}.actor.optim.betas": "actor.optim.betas",
    f"{A}.actor.optim.weight_decay": "actor.optim.weight_decay",
    f"{A}.actor.optim.clip_grad": "actor.optim.grad_clip",
    f"{A}.actor.optim.lr_warmup_steps_ratio": "actor.optim.lr_warmup_steps_ratio",
    f"{A}.actor.optim.lr_warmup_steps": "actor.optim.lr_warmup_steps",
    f"{A}.actor.optim.min_lr_ratio": "actor.optim.min_lr_ratio",
    f"{A}.actor.optim.lr_scheduler_type": "actor.optim.lr_scheduler",
    f"{A}.actor.optim.warmup_style": "actor.optim.lr_scheduler",
    f"{A}.actor.optim.total_training_steps": "actor.optim.total_training_steps",
    # the old-log-prob pass (verl configures it under the rollout) and the reference
    f"{A}.rollout.log_prob_micro_batch_size_per_gpu": "actor.log_prob_micro_batch_size_per_device",
    f"{A}.rollout.log_prob_max_token_len_per_gpu": "actor.log_prob_max_token_len_per_gpu",
    f"{A}.ref.log_prob_micro_batch_size_per_gpu": "ref.log_prob_micro_batch_size_per_device",
    f"{A}.ref.log_prob_use_dynamic_bsz": "ref.log_prob_use_dynamic_bsz",
    f"{A}.ref.log_prob_max_token_len_per_gpu": "ref.log_prob_max_token_len_per_gpu",
    # generation
    f"{A}.rollout.name": "rollout.name",
    f"{A}.rollout.n": "rollout.n",
    f"{A}.rollout.temperature": "rollout.temperature",
    f"{A}.rollout.top_k": "rollout.top_k",
    f"{A}.rollout.top_p": "rollout.top_p",
    f"{A}.rollout.do_sample": "rollout.do_sample",
    f"{A}.rollout.prompt_length": "rollout.prompt_length",
    f"{A}.rollout.response_length": "rollout.response_length",
    f"{A}.rollout.dtype": "rollout.dtype",
    f"{A}.rollout.ignore_eos": "rollout.ignore_eos",
    f"{A}.rollout.enforce_eager": "rollout.enforce_eager",
    f"{A}.rollout.free_cache_engine": "rollout.free_cache_engine",
    f"{A}.rollout.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    f"{A}.rollout.tensor_model_parallel_size": "rollout.tensor_model_parallel_size",
    f"{A}.rollout.calculate_log_probs": "rollout.calculate_log_probs",
    f"{A}.rollout.max_num_seqs": "rollout.max_batch_size",
    f"{A}.rollout.val_kwargs.temperature": "rollout.val_kwargs.temperature",
    f"{A}.rollout.val_kwargs.top_k": "rollout.val_kwargs.top_k",
    f"{A}.rollout.val_kwargs.top_p": "rollout.val_kwargs.top_p",
    f"{A}.rollout.val_kwargs.do_sample": "rollout.val_kwargs.do_sample",
    f"{A}.rollout.val_kwargs.n": "rollout.val_kwargs.n",
    # the critic (keys verl spells like hybridflow pass unchanged)
    "critic.ppo_micro_batch_size_per_gpu": "critic.ppo_micro_batch_size_per_device",
    "critic.grad_clip": "critic.optim.grad_clip",
    "critic.optim.clip_grad": "critic.optim.grad_clip",
    "critic.optim.lr_scheduler_type": "critic.optim.lr_scheduler",
    "critic.optim.warmup_style": "critic.optim.lr_scheduler",
    "critic.ulysses_sequence_parallel_size": "critic.engine.ulysses_sequence_parallel_size",
    "critic.model.enable_gradient_checkpointing": "critic.engine.gradient_checkpointing",
    "critic.model.use_remove_padding": "critic.engine.use_remove_padding",
    # reward model, algorithm, trainer
    "reward_model.micro_batch_size_per_gpu": "reward_model.micro_batch_size_per_device",
    "reward_model.num_workers": "reward.num_workers",
    "reward_model.model.input_tokenizer": "reward_model.input_tokenizer",
    # a generative reward model served by an inference engine: hybridflow's judge (see GENERATIVE_RM)
    "reward_model.rollout.name": "judge.rollout.name",
    "reward_model.rollout.prompt_length": "judge.rollout.prompt_length",
    "reward_model.rollout.response_length": "judge.rollout.response_length",
    "reward_model.rollout.dtype": "judge.rollout.dtype",
    "reward_model.rollout.temperature": "judge.rollout.temperature",
    "reward_model.rollout.top_p": "judge.rollout.top_p",
    "reward_model.rollout.top_k": "judge.rollout.top_k",
    "reward_model.rollout.do_sample": "judge.rollout.do_sample",
    "reward_model.rollout.tensor_model_parallel_size": "judge.rollout.tensor_model_parallel_size",
    "reward_model.rollout.gpu_memory_utilization": "judge.rollout.gpu_memory_utilization",
    "reward_model.rollout.enforce_eager": "judge.rollout.enforce_eager",
    "reward_model.rollout.free_cache_engine": "judge.rollout.free_cache_engine",
    "reward_model.rollout.max_num_seqs": "judge.rollout.max_batch_size",
    "custom_reward_function.path": "reward.custom_reward_function.path",
    "custom_reward_function.name": "reward.custom_reward_function.name",
    "algorithm.rollout_correction.rollout_is_threshold": "algorithm.rollout_is_threshold",
    "trainer.n_gpus_per_node": "trainer.n_workers_per_node",
    "trainer.max_actor_ckpt_to_keep": "trainer.max_ckpt_to_keep",
    # on-policy distillation (verl's distillation section; distillation.enabled is spelled the same)
    "distillation.teacher_models.*.model_path": "distillation.teacher.path",
    "distillation.teacher_model.model_path": "distillation.teacher.path",
    "distillation.distillation_loss.loss_mode": "distillation.kl_estimator",
    "distillation.distillation_loss.distillation_loss_coef": "distillation.coef",
    "distillation.distillation_loss.use_task_rewards": "distillation.use_task_rewards",
    "distillation.distillation_loss.loss_max_clamp": "distillation.kl_clamp",
    "distillation.distillation_loss.log_prob_min_clamp": "distillation.log_prob_min_clamp",
    "async_training.partial_rollout": "trainer.partial_rollout",  # verl's fully-async recipe
}
NAMED: tuple[str, ...] = ("distillation.teacher_models",)
"""verl sections keyed by a user-chosen name (`distillation.teacher_models.<name>.model_path`): their keys are
looked up with the name as `*`. hybridflow distills from one teacher: two names in one run are refused."""
for _verl, _mine in ((f"{A}.actor", "actor"), ("critic.model", "critic")):  # fsdp_config keys of an engine here
    RENAMED[f"{_verl}.fsdp_config.fsdp_size"] = f"{_mine}.engine.fsdp_size"
    RENAMED[f"{_verl}.fsdp_config.reshard_after_forward"] = f"{_mine}.engine.reshard_after_forward"
    RENAMED[f"{_verl}.fsdp_config.ulysses_sequence_parallel_size"] = f"{_mine}.engine.ulysses_sequence_parallel_size"
for _verl, _mine in _internal.FSDP.items():  # verl's mixed-precision compute dtype of a role
    RENAMED[f"{_verl}.dtype"] = f"{_mine}.param_dtype"

GENERATIVE_RM: dict[str, str] = {
    "reward_model.enable": "judge.enable",
    "reward_model.model.path": "judge.model.path",
}
"""verl keys that mean the judge when the same layer names an inference engine for the reward model
(`reward_model.rollout.name` set, not verl's `???`): verl's generative reward model is reward_model.enable +
reward_model.model.path + reward_model.rollout.*, with the prompt template and the verdict parser inside a custom
reward function that calls verl's `reward_router_address`. hybridflow has no HTTP router for the judge (its worker
is called once per step with every row) and takes the template and parser as judge.template / judge.parser
plugins; without reward_model.rollout.name these keys keep their meaning: the scalar reward model."""

NULL_IS_UNSET = frozenset(
    {
        f"{A}.actor.optim.warmup_style",  # verl's deprecated alias of lr_scheduler_type
        "critic.optim.warmup_style",
        f"{A}.actor.ppo_micro_batch_size_per_gpu",  # verl's defaults leave micro-batch sizes unset ...
        f"{A}.rollout.log_prob_micro_batch_size_per_gpu",
        f"{A}.ref.log_prob_micro_batch_size_per_gpu",
        "critic.ppo_micro_batch_size_per_gpu",
        "reward_model.micro_batch_size_per_gpu",
        "data.seed",  # ... and the data seed (an unseeded shuffle in verl)
    }
)
"""verl keys whose null means "not set": a null is dropped, so hybridflow's default holds (a deprecated alias does
not overwrite the key it aliases). verl's generated config leaves these null: verl refuses a null micro-batch size
unless the script sets it (or use_dynamic_bsz); hybridflow keeps its own default, which changes memory and speed,
not the update. A null data.seed is an unseeded shuffle in verl; hybridflow seeds it with its default (0)."""

SETS: dict[str, dict[Any, dict[str, Any]]] = {
    "algorithm.rollout_correction.rollout_is": {
        None: {"algorithm.rollout_is": False},
        "token": {"algorithm.rollout_is": True, "algorithm.rollout_is_level": "token"},
        "sequence": {"algorithm.rollout_is": True, "algorithm.rollout_is_level": "sequence"},
    },
    "distillation.distillation_loss.use_policy_gradient": {
        True: {"distillation.signal": "advantage"},
        False: {"distillation.signal": "loss"},
    },
}
"""verl keys whose value sets several hybridflow keys: verl value -> {hybridflow key: value}; other values are
refused. verl's rollout_is is the IS level or null (weights off, mismatch metrics only)."""

_OFFLOAD = (
    "FSDP CPU offload is not in hybridflow's engine: on CPU the weights and optimizer state live in host memory "
    "already; on a GPU they stay on the device"
)
_CUDA_KERNEL = "a CUDA kernel option: hybridflow's CPU path has no such kernel"
_VLLM_GPU = "a vLLM engine knob of verl's GPU server: hybridflow's rollouts size themselves (rollout.max_batch_size)"
_TEACHER_PLACED = (
    "the teacher's own resource pool: hybridflow places the teacher with the reference policy (trainer.placement)"
)
_TEACHER_ENGINE = (
    "verl's inference server for the teacher: hybridflow's teacher is a forward-only engine in the workers"
)
_DISTILL_PG = (
    "the distillation advantage goes through the actor's own policy loss (actor.policy_loss_mode, "
    "actor.policy_loss.clip_ratio*)"
)
NO_EFFECT: dict[str, str] = {
    f"{A}.model.use_liger": _CUDA_KERNEL + " (Liger)",
    f"{A}.model.use_fused_kernels": _CUDA_KERNEL + " (fused log-prob/entropy)",
    f"{A}.model.fused_kernel_options.*": _CUDA_KERNEL + " (fused log-prob/entropy)",
    f"{A}.model.enable_activation_offload": "activation offload to CPU: activations are in host memory already",
    "critic.model.enable_activation_offload": "activation offload to CPU: activations are in host memory already",
    f"{A}.model.use_shm": "copying the model through /dev/shm: models load from a local directory here",
    f"{A}.hybrid_engine": "hybridflow always colocates actor and rollout in one worker (trainer.placement)",
    f"{A}.actor.strategy": "hybridflow's engine is always FSDP2 (its tp/sp variants: actor.engine.backend)",
    f"{A}.ref.strategy": "hybridflow's engine is always FSDP2",
    "critic.strategy": "hybridflow's engine is always FSDP2",
    "reward_model.strategy": "hybridflow's engine is always FSDP2",
    f"{A}.actor.use_torch_compile": "torch.compile of the log-prob head: CUDA only in verl",
    f"{A}.ref.use_torch_compile": "torch.compile of the log-prob head: CUDA only in verl",
    f"{A}.actor.entropy_from_logits_with_chunking": "hybridflow always chunks logits (engine.logits_chunk_size)",
    f"{A}.actor.entropy_checkpointing": "GPU memory saving for the entropy: logits are chunked here",
    f"{A}.rollout.load_format": "how vLLM on a GPU loads initial weights: hybridflow's rollout gets the actor's",
    f"{A}.rollout.layered_summon": "layer-by-layer gather of FSDP LoRA weights to the GPU rollout",
    f"{A}.rollout.mode": "the rollout runs inside the actor workers here (verl's sync/async server modes)",
    f"{A}.rollout.max_num_batched_tokens": _VLLM_GPU,
    f"{A}.rollout.enable_chunked_prefill": _VLLM_GPU,
    f"{A}.rollout.enable_prefix_caching": _VLLM_GPU,
    f"{A}.rollout.cudagraph_capture_sizes": _VLLM_GPU,
    f"{A}.rollout.disable_log_stats": _VLLM_GPU,
    f"{A}.rollout.multi_stage_wake_up": _VLLM_GPU,
    f"{A}.rollout.skip_tokenizer_init": _VLLM_GPU,
    f"{A}.rollout.multi_turn.*": "a verl multi-turn setting with no counterpart here (tool_config_path: verl's file format differs)",
    f"{A}.rollout.log_prob_use_dynamic_bsz": "the old-log-prob pass follows actor.use_dynamic_bsz here",
    "data.dataloader_num_workers": "prompts are tokenized once, up front: no loader processes",
    "data.filter_overlong_prompts_workers": "prompts are tokenized once, up front: no loader processes",
    "data.use_shm": "data files are read from local paths here",
    "data.return_raw_chat": "hybridflow always keeps the raw chat with each row",
    "data.return_raw_input_ids": "hybridflow always keeps the raw chat with each row",
    "data.return_full_prompt": "hybridflow always keeps the raw chat with each row",
    "trainer.use_legacy_worker_impl": "hybridflow has one worker implementation",
    "trainer.ray_wait_register_center_timeout": "workers register through trainer.call_timeout_s here",
    "trainer.esi_redundant_time": "an elastic-training deadline of verl's GPU clusters",
    "distillation.num_workers": _TEACHER_PLACED,
    "distillation.enable_resource_pool": _TEACHER_PLACED,
    "distillation.n_gpus_per_node": _TEACHER_PLACED,
    "distillation.nnodes": _TEACHER_PLACED,
    "distillation.teacher_model.enable_resource_pool": _TEACHER_PLACED,
    "distillation.teacher_model.n_gpus_per_node": _TEACHER_PLACED,
    "distillation.teacher_model.nnodes": _TEACHER_PLACED,
    "distillation.teacher_model.inference.*": _TEACHER_ENGINE,
    "distillation.teacher_models.*": _TEACHER_ENGINE,
    "distillation.distillation_loss.topk": "a parameter of verl's top-k losses, not offered here "
    "(distillation.kl_estimator: single-sample estimators)",
    "distillation.distillation_loss.jsd_beta": "a parameter of verl's JSD loss, not offered here",
    "distillation.distillation_loss.policy_loss_mode": _DISTILL_PG,
    "distillation.distillation_loss.clip_ratio": _DISTILL_PG,
    "distillation.distillation_loss.clip_ratio_low": _DISTILL_PG,
    "distillation.distillation_loss.clip_ratio_high": _DISTILL_PG,
}
for _verl in ROLES:
    for _leaf in ("param_offload", "optimizer_offload", "offload_policy"):
        NO_EFFECT[f"{_verl}.fsdp_config.{_leaf}"] = _OFFLOAD
    for _leaf in ("forward_prefetch", "wrap_policy.*", "use_orig_params", "use_torch_compile", "strategy"):
        NO_EFFECT[f"{_verl}.fsdp_config.{_leaf}"] = "an FSDP1 / CUDA tuning knob: hybridflow wraps each layer in FSDP2"

NOT_YET: dict[str, str] = {
    f"{A}.model.custom_chat_template": "chat template other than the tokenizer's",
    f"{A}.model.external_lib": "importing a model library by name (user code goes in trainer.plugins)",
    f"{A}.model.override_config.*": "overriding the model's HF config",
    f"{A}.model.override_config": "overriding the model's HF config",
    f"{A}.model.trust_remote_code": "models with custom code (trust_remote_code)",
    f"{A}.model.lora_adapter_path": "starting from a saved LoRA adapter",
    f"{A}.model.exclude_modules": "excluding modules from LoRA (use actor.lora.target_modules)",
    f"{A}.model.tiled_mlp.*": "tiled MLP",
    f"{A}.actor.checkpoint.*": "choosing what a checkpoint holds (hybridflow always saves model, optimizer "
    "and extra: the LR schedule and rng)",
    f"{A}.actor.loss_scale_factor": "fixed loss scale factor",
    f"{A}.actor.use_prefix_grouper": "verl's prefix grouper (hybridflow shares prompts: actor.engine.share_prompts)",
    f"{A}.actor.freeze_vision_tower": "vision-language models",
    f"{A}.actor.calculate_entropy": "switching the entropy metric off",
    f"{A}.actor.calculate_sum_pi_squared": "the sum-of-squared-probabilities metric",
    f"{A}.actor.data_loader_seed": "separate mini-batch shuffle seed (the step seeds it)",
    f"{A}.rollout.over_sample_rate": "over-sampling and aborting the slowest responses",
    f"{A}.rollout.data_parallel_size": "data parallel inside one rollout engine",
    f"{A}.rollout.expert_parallel_size": "mixture-of-experts models",
    f"{A}.rollout.pipeline_model_parallel_size": "pipeline parallel rollout",
    f"{A}.rollout.max_model_len": "rollout context other than prompt + response length",
    f"{A}.rollout.logprobs_mode": "choosing the rollout's log-prob mode (vllm returns verl's default, "
    "processed_logprobs; the "
    "native rollout's are taken before top-k/top-p filtering)",
    f"{A}.rollout.skip_rollout": "dumping and replaying rollouts",
    f"{A}.rollout.agent.*": "verl's agent-loop classes and server workers (hybridflow: rollout.agent.function)",
    f"{A}.rollout.engine_kwargs.*": "passing raw engine arguments to vLLM / SGLang",
    "critic.forward_micro_batch_size_per_gpu": "separate compute_values micro-batch (it is ppo_micro_batch_size)",
    "critic.model.override_config.*": "overriding the model's HF config",
    "critic.model.lora_rank": "LoRA critic",
    "reward_model.reward_manager": "reward managers other than verl's naive one (the one hybridflow has)",
    "reward_model.launch_reward_fn_async": "scoring rewards asynchronously",
    "reward_model.sandbox_fusion.url": "sandbox-fusion code execution rewards",
    "algorithm.use_pf_ppo": "policy-filtration PPO",
    "algorithm.rollout_correction.rollout_rs": "rejection sampling of mismatched rollouts",
    "data.custom_cls.*": "custom dataset classes",
    "data.sampler.*": "custom curriculum samplers",
    "data.datagen.*": "dynamic data generation",
    "data.image_key": "vision-language data",
    "data.video_key": "vision-language data",
    "data.prompt_key": "prompt column other than 'prompt'",
    "data.reward_fn_key": "reward column other than 'data_source'",
    "data.train_max_samples": "capping the number of training rows",
    "data.val_max_samples": "capping the number of validation rows",
    "data.apply_chat_template_kwargs.*": "chat-template arguments",
    "data.tokenizer": "data tokenizer other than the model's (model.tokenizer_path)",
    "trainer.log_val_generations": "logging validation generations",
    "trainer.rollout_data_dir": "dumping rollouts to a directory",
    "trainer.validation_data_dir": "dumping validation generations to a directory",
    "trainer.default_hdfs_dir": "checkpoints on HDFS",
    "trainer.del_local_ckpt_after_load": "deleting a checkpoint after loading it",
    "trainer.max_critic_ckpt_to_keep": "separate critic checkpoint limit (trainer.max_ckpt_to_keep)",
}
ACCEPTED: dict[str, tuple[Any, ...]] = {
    f"{A}.rollout.data_parallel_size": (1,),
    f"{A}.rollout.expert_parallel_size": (1,),
    f"{A}.rollout.pipeline_model_parallel_size": (1,),
    "reward_model.reward_manager": ("naive",),
    "data.prompt_key": ("prompt",),
    "data.reward_fn_key": ("data_source",),
    # verl's defaults that are what hybridflow does (its generated config lists every key at its default)
    f"{A}.actor.data_loader_seed": (42,),  # seeds only a shuffle; hybridflow's is seeded by the step
    f"{A}.actor.checkpoint.save_contents": (["model", "optimizer", "extra"],),
    f"{A}.actor.checkpoint.load_contents": (["model", "optimizer", "extra"],),
    f"{A}.rollout.logprobs_mode": ("processed_logprobs",),  # read only for rollout IS / mismatch metrics
    f"{A}.rollout.agent.default_agent_loop": ("single_turn_agent",),  # one generation per prompt
    "data.image_key": ("images",),  # a column name: a file with images in it is refused when read (data/dataset.py)
    "data.video_key": ("videos",),
    **_internal.ACCEPTED,
}
"""Values of a `NOT_YET` key that are what hybridflow does (besides the values that leave a feature off)."""

for _mine, _theirs in ((NO_EFFECT, _internal.NO_EFFECT), (NOT_YET, _internal.NOT_YET)):
    _twice = sorted(set(_theirs) & (set(RENAMED) | set(SETS) | set(NO_EFFECT) | set(NOT_YET)))
    if _twice:
        raise AssertionError(f"verl keys listed twice (verl_keys_internal and another table): {_twice}")
    _mine.update(_theirs)

_NO_LIMIT = 1_000_000
"""verl's null turn limit: none (the response length still bounds a trajectory)."""
_DTYPES = {"bfloat16": "bf16", "float32": "fp32", "fp32": "fp32", "bf16": "bf16"}
VALUES: dict[str, dict[Any, Any]] = {
    "rollout.dtype": _DTYPES,
    "judge.rollout.dtype": _DTYPES,
    "judge.rollout.name": {"???": "native"},  # verl's unset engine of its (disabled) reward model
    **{f"{mine}.param_dtype": _DTYPES for mine in _internal.FSDP.values()},
    "actor.optim.total_training_steps": {-1: None},  # verl's -1: the run's length, injected by its trainer
    "critic.optim.total_training_steps": {-1: None},
    "rollout.multi_turn.max_assistant_turns": {None: _NO_LIMIT},
    "rollout.multi_turn.max_user_turns": {None: _NO_LIMIT},
}
"""Values verl spells differently, by hybridflow key: verl value -> hybridflow value (others pass unchanged)."""

VERL_DEFAULTS: dict[str, Any] = {
    "algorithm.adv_estimator": "gae",
    "rollout.n": 1,
    "data.train_batch_size": 1024,
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "data.filter_overlong_prompts": False,
    "actor.ppo_mini_batch_size": 256,
    "actor.optim.lr": 1e-6,
    "critic.ppo_mini_batch_size": "${actor.ppo_mini_batch_size}",
    "critic.ppo_epochs": "${actor.ppo_epochs}",
    "critic.loss_agg_mode": "${actor.loss_agg_mode}",
    "critic.use_dynamic_bsz": "${actor.use_dynamic_bsz}",
    "rollout.val_kwargs.temperature": 0.0,
    "trainer.total_epochs": 30,
    "trainer.total_training_steps": None,
    "trainer.test_freq": -1,
    "trainer.logger": ["console"],
    "trainer.project_name": "verl_examples",
    "trainer.experiment_name": "gsm8k",
    "trainer.n_workers_per_node": None,
}
"""verl's defaults where they differ from hybridflow's, by hybridflow key (`${...}`: follows that key, as in
verl). Departures on purpose: trainer.n_workers_per_node stays null (chosen for this machine, not verl's 8
GPUs), trainer.logger is console only (verl adds wandb, which needs an account), trainer.device stays cpu."""
