"""Fixtures: the override lists of ten of verl's own example run scripts (volcengine/verl: docs/start/quickstart.rst,
examples/{grpo,ppo,rloo,reinforce_plus_plus}_trainer/*.sh), as the shell passes them (quotes removed, the scripts'
own shell variables filled in). `local(name, model, task_dir)` swaps what points outside this machine: the model
paths for a local model, the data files for a generated task, and the vllm/sglang rollout (not installed here)
for the native one. Everything else is verl's script as written.
"""

from __future__ import annotations

SCRIPTS: dict[str, str] = {
    "grpo_deepseek7b": """
        algorithm.adv_estimator=grpo data.train_files=$HOME/data/gsm8k/train.parquet
        data.val_files=$HOME/data/gsm8k/test.parquet data.train_batch_size=1024 data.max_prompt_length=512
        data.max_response_length=1024 data.filter_overlong_prompts=True data.truncation=error
        actor_rollout_ref.model.path=deepseek-ai/deepseek-llm-7b-chat actor_rollout_ref.actor.optim.lr=1e-6
        actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=256
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=80 actor_rollout_ref.actor.use_kl_loss=True
        actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
        actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True
        actor_rollout_ref.actor.fsdp_config.param_offload=False
        actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
        actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=160
        actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
        actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
        actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=160
        actor_rollout_ref.ref.fsdp_config.param_offload=True algorithm.use_kl_in_reward=False
        trainer.critic_warmup=0 trainer.logger=console trainer.project_name=verl_grpo_example_gsm8k
        trainer.experiment_name=deepseek_llm_7b_function_rm trainer.n_gpus_per_node=8 trainer.nnodes=1
        trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15
    """,
    "grpo_lora_qwen2_5_3b": """
        algorithm.adv_estimator=grpo trainer.val_before_train=False
        data.train_files=$HOME/data/gsm8k/train.parquet data.val_files=$HOME/data/gsm8k/test.parquet
        data.train_batch_size=16 data.max_prompt_length=512 data.max_response_length=1024
        data.filter_overlong_prompts=True data.truncation=error data.shuffle=False
        actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct actor_rollout_ref.model.lora_rank=64
        actor_rollout_ref.model.lora_alpha=32 actor_rollout_ref.actor.optim.lr=3e-6
        actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=16
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 actor_rollout_ref.actor.use_kl_loss=True
        actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
        actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True
        actor_rollout_ref.actor.fsdp_config.param_offload=False
        actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
        actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40
        actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
        actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
        actor_rollout_ref.rollout.load_format=safetensors actor_rollout_ref.rollout.layered_summon=True
        actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40
        actor_rollout_ref.ref.fsdp_config.param_offload=True algorithm.use_kl_in_reward=False
        trainer.critic_warmup=0 trainer.logger=["console","wandb"] trainer.project_name=verl_grpo_example_gsm8k
        trainer.experiment_name=qwen2.5_3b_grpo_lora trainer.n_gpus_per_node=2 trainer.nnodes=1
        trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15
    """,
    "grpo_qwen2_7b": """
        algorithm.adv_estimator=grpo data.train_files=$HOME/data/gsm8k/train.parquet
        data.val_files=$HOME/data/gsm8k/test.parquet data.train_batch_size=1024 data.max_prompt_length=512
        data.max_response_length=1024 data.filter_overlong_prompts=True data.truncation=error
        actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct actor_rollout_ref.actor.optim.lr=1e-6
        actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=256
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 actor_rollout_ref.actor.use_kl_loss=True
        actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
        actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True
        actor_rollout_ref.actor.fsdp_config.param_offload=False
        actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
        actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40
        actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
        actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
        actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40
        actor_rollout_ref.ref.fsdp_config.param_offload=True algorithm.use_kl_in_reward=False
        trainer.critic_warmup=0 trainer.logger=["console","wandb"] trainer.project_name=verl_grpo_example_gsm8k
        trainer.experiment_name=qwen2_7b_function_rm trainer.n_gpus_per_node=8 trainer.nnodes=1
        trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15
    """,
    "grpo_seq_balance_qwen2_7b": """
        algorithm.adv_estimator=grpo data.train_files=$HOME/data/gsm8k/train.parquet
        data.val_files=$HOME/data/gsm8k/test.parquet data.return_raw_chat=True data.train_batch_size=1024
        data.max_prompt_length=512 data.max_response_length=1024 data.filter_overlong_prompts=True
        data.truncation=error actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct
        actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.model.use_remove_padding=True
        actor_rollout_ref.actor.ppo_mini_batch_size=256 actor_rollout_ref.actor.use_dynamic_bsz=True
        actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24000 actor_rollout_ref.actor.use_kl_loss=True
        actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
        actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True
        actor_rollout_ref.actor.fsdp_config.param_offload=False
        actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
        actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
        actor_rollout_ref.rollout.mode=async actor_rollout_ref.rollout.multi_turn.format=hermes
        actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
        actor_rollout_ref.ref.fsdp_config.param_offload=True algorithm.use_kl_in_reward=False
        trainer.critic_warmup=0 trainer.logger=["console","wandb"] trainer.project_name=verl_grpo_example_gsm8k
        trainer.experiment_name=qwen2_7b_function_rm_kl1e-3 trainer.val_before_train=False
        trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5
        trainer.total_epochs=15
    """,
    "ppo_deepseek7b": """
        algorithm.adv_estimator=gae data.train_files=$HOME/data/gsm8k/train.parquet
        data.val_files=$HOME/data/gsm8k/test.parquet data.train_batch_size=1024 data.max_prompt_length=512
        data.max_response_length=512 data.filter_overlong_prompts=True data.truncation=error
        actor_rollout_ref.model.path=deepseek-ai/deepseek-llm-7b-chat actor_rollout_ref.actor.optim.lr=1e-6
        actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=256
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16
        actor_rollout_ref.actor.fsdp_config.param_offload=False
        actor_rollout_ref.actor.fsdp_config.optimizer_offload=False actor_rollout_ref.actor.use_kl_loss=False
        actor_rollout_ref.model.enable_gradient_checkpointing=True
        actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32
        actor_rollout_ref.rollout.tensor_model_parallel_size=4 actor_rollout_ref.rollout.name=vllm
        actor_rollout_ref.rollout.gpu_memory_utilization=0.4 critic.optim.lr=1e-5
        critic.model.use_remove_padding=True critic.model.path=deepseek-ai/deepseek-llm-7b-chat
        critic.model.enable_gradient_checkpointing=True critic.ppo_micro_batch_size_per_gpu=32
        critic.model.fsdp_config.param_offload=False critic.model.fsdp_config.optimizer_offload=False
        algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger=["console","wandb"]
        trainer.project_name=verl_example_gsm8k trainer.experiment_name=deepseek_llm_7b_function_rm
        trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=1
        trainer.use_legacy_worker_impl=auto trainer.total_epochs=15
    """,
    "ppo_gemma": """
        algorithm.adv_estimator=gae data.train_files=$HOME/data/gsm8k/train.parquet
        data.val_files=$HOME/data/gsm8k/test.parquet data.train_batch_size=512 data.max_prompt_length=1024
        data.max_response_length=512 data.filter_overlong_prompts=True data.truncation=error
        actor_rollout_ref.model.path=google/gemma-2-2b-it actor_rollout_ref.actor.optim.lr=1e-6
        actor_rollout_ref.model.use_remove_padding=False actor_rollout_ref.actor.ppo_mini_batch_size=128
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
        actor_rollout_ref.actor.fsdp_config.param_offload=False
        actor_rollout_ref.actor.fsdp_config.optimizer_offload=False actor_rollout_ref.actor.use_kl_loss=False
        actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4
        actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
        actor_rollout_ref.rollout.gpu_memory_utilization=0.4 critic.optim.lr=1e-5
        critic.model.use_remove_padding=False critic.model.path=google/gemma-2-2b-it
        critic.model.enable_gradient_checkpointing=False critic.ppo_micro_batch_size_per_gpu=4
        critic.model.fsdp_config.param_offload=False critic.model.fsdp_config.optimizer_offload=False
        algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger=["console","wandb"]
        trainer.project_name=verl_example trainer.experiment_name=gemma2b_function_rm trainer.n_gpus_per_node=2
        trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=10 trainer.total_epochs=15
    """,
    "ppo_seq_balance_qwen2_7b": """
        algorithm.adv_estimator=gae data.train_files="$train_files" data.val_files="$test_files"
        data.return_raw_chat=True data.train_batch_size=4096 data.max_prompt_length=4096
        data.max_response_length=4096 data.filter_overlong_prompts=True data.truncation=error
        actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct actor_rollout_ref.actor.optim.lr=1e-6
        actor_rollout_ref.model.use_remove_padding=True
        actor_rollout_ref.model.enable_gradient_checkpointing=True
        actor_rollout_ref.actor.ppo_mini_batch_size=512 actor_rollout_ref.actor.use_dynamic_bsz=True
        actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24000
        actor_rollout_ref.actor.fsdp_config.param_offload=False
        actor_rollout_ref.actor.fsdp_config.optimizer_offload=False actor_rollout_ref.actor.use_kl_loss=False
        actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
        actor_rollout_ref.rollout.mode=async actor_rollout_ref.rollout.multi_turn.format=hermes
        actor_rollout_ref.rollout.gpu_memory_utilization=0.5
        actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24000 critic.optim.lr=1e-5
        critic.model.use_remove_padding=True critic.model.path=Qwen/Qwen2-7B-Instruct
        critic.model.enable_gradient_checkpointing=True critic.ppo_max_token_len_per_gpu=98304
        critic.model.fsdp_config.param_offload=False critic.model.fsdp_config.optimizer_offload=False
        algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger=["console","wandb"]
        trainer.project_name=verl_example_gsm8k
        trainer.experiment_name=qwen2-7b_function_rm_bsz8k_p4k_r4k_seq_packing trainer.n_gpus_per_node=8
        trainer.val_before_train=False trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5
        trainer.total_epochs=15
    """,
    "quickstart": """
        data.train_files=$HOME/data/gsm8k/train.parquet data.val_files=$HOME/data/gsm8k/test.parquet
        data.train_batch_size=256 data.max_prompt_length=512 data.max_response_length=512
        actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct actor_rollout_ref.actor.optim.lr=1e-6
        actor_rollout_ref.actor.ppo_mini_batch_size=64 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
        actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
        actor_rollout_ref.rollout.tensor_model_parallel_size=1
        actor_rollout_ref.rollout.gpu_memory_utilization=0.4
        actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 critic.optim.lr=1e-5
        critic.model.path=Qwen/Qwen2.5-0.5B-Instruct critic.ppo_micro_batch_size_per_gpu=4
        algorithm.kl_ctrl.kl_coef=0.001 trainer.logger=console trainer.val_before_train=False
        trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.save_freq=10 trainer.test_freq=10
        trainer.total_epochs=15
    """,
    "reinforce_pp_qwen2_7b_math": """
        algorithm.adv_estimator=reinforce_plus_plus data.train_files="$train_files" data.val_files="$test_files"
        data.train_batch_size=1024 data.max_prompt_length=1024 data.max_response_length=1024
        data.filter_overlong_prompts=True data.truncation=error
        actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct actor_rollout_ref.actor.optim.lr=3e-6
        actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=1024
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 actor_rollout_ref.actor.use_kl_loss=False
        actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=mse
        actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True
        actor_rollout_ref.actor.fsdp_config.param_offload=False
        actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
        actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16
        actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
        actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=8
        actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16
        actor_rollout_ref.ref.fsdp_config.param_offload=True algorithm.use_kl_in_reward=True
        trainer.critic_warmup=0 trainer.logger=["console","wandb"] trainer.project_name=verl_grpo_example_gsm8k
        trainer.experiment_name=qwen2_7b_function_rm trainer.n_gpus_per_node=16 trainer.nnodes=1
        trainer.save_freq=-1 trainer.test_freq=5 trainer.total_epochs=15
    """,
    "rloo_qwen2_7b": """
        algorithm.adv_estimator=rloo data.train_files=$HOME/data/gsm8k/train.parquet
        data.val_files=$HOME/data/gsm8k/test.parquet data.train_batch_size=1024 data.max_prompt_length=512
        data.max_response_length=1024 data.filter_overlong_prompts=True data.truncation=error
        actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct actor_rollout_ref.actor.optim.lr=1e-6
        actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.ppo_mini_batch_size=256
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=80 actor_rollout_ref.actor.use_kl_loss=False
        actor_rollout_ref.model.enable_gradient_checkpointing=True
        actor_rollout_ref.actor.fsdp_config.param_offload=False
        actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
        actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=160
        actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
        actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
        actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=160
        actor_rollout_ref.ref.fsdp_config.param_offload=True algorithm.use_kl_in_reward=True
        algorithm.kl_penalty=kl algorithm.kl_ctrl.kl_coef=0.001 trainer.critic_warmup=0
        trainer.logger=["console","wandb"] trainer.project_name=verl_rloo_example_gsm8k
        trainer.experiment_name=qwen2_7b_function_rm trainer.n_gpus_per_node=8 trainer.nnodes=1
        trainer.save_freq=-1 trainer.test_freq=5 trainer.total_epochs=15
    """,
}

MODEL_KEYS = ("actor_rollout_ref.model.path=", "critic.model.path=")
DATA_KEYS = ("data.train_files=", "data.val_files=")


def local(name: str, model: str, task_dir: str, gen_train_size: int = 2048) -> list[str]:
    """Script `name`'s overrides with the model, data and rollout backend swapped for local ones."""
    out = []
    for line in SCRIPTS[name].split():
        if line.startswith(DATA_KEYS):
            continue
        if line.startswith(MODEL_KEYS):
            line = line.split("=")[0] + "=" + model
        if line.startswith("actor_rollout_ref.rollout.name="):
            line = "actor_rollout_ref.rollout.name=native"
        out.append(line)
    return out + [f"data.task_dir={task_dir}", f"data.gen_train_size={gen_train_size}", "data.gen_val_size=8"]
