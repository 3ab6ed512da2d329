"""verl's DataProto helpers (hybridflow.protocol), checked against verl's documented behaviour."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from hybridflow.protocol import (
    DataProto,
    DataProtoConfig,
    deserialize_single_tensor,
    deserialize_tensordict,
    serialize_single_tensor,
    serialize_tensordict,
    union_numpy_dict,
    union_tensor_dict,
)


def batch(n: int = 4) -> DataProto:
    return DataProto.from_dict(
        {"x": torch.arange(n * 2).reshape(n, 2)}, {"uid": [f"u{i}" for i in range(n)]}, {"step": 3}
    )


def test_union_tensor_dict_adds_new_keys_in_place_and_refuses_a_differing_one():
    a = TensorDict({"x": torch.tensor([1, 2])}, batch_size=[2])
    b = TensorDict({"x": torch.tensor([1, 2]), "y": torch.tensor([3, 4])}, batch_size=[2])
    out = union_tensor_dict(a, b)
    assert out is a and out["y"].tolist() == [3, 4]
    with pytest.raises(ValueError, match="'x' differs"):
        union_tensor_dict(a, TensorDict({"x": torch.tensor([9, 9])}, batch_size=[2]))
    with pytest.raises(ValueError, match="batch sizes differ"):
        union_tensor_dict(a, TensorDict({}, batch_size=[3]))


def test_union_numpy_dict_treats_nan_and_objects_as_equal_values():
    a = {"f": np.array([1.0, np.nan]), "o": np.array([{"k": 1}, "s"], dtype=object)}
    b = {"f": np.array([1.0, np.nan]), "o": np.array([{"k": 1}, "s"], dtype=object), "n": np.array([7])}
    out = union_numpy_dict(a, b)
    assert out is a and out["n"].tolist() == [7]
    with pytest.raises(ValueError, match="'f' differs"):
        union_numpy_dict(a, {"f": np.array([1.0, 2.0])})


def test_single_tensor_codec_keeps_dtype_shape_and_values():
    t = torch.tensor([[1.5, -2.0], [0.25, 8.0]], dtype=torch.bfloat16)
    dtype, shape, data = serialize_single_tensor(t)
    assert (dtype, tuple(shape), data.dtype, data.size) == ("bfloat16", (2, 2), np.uint8, 8)
    back = deserialize_single_tensor((dtype, shape, data))
    assert back.dtype == torch.bfloat16 and back.tolist() == [[1.5, -2.0], [0.25, 8.0]]


def test_tensordict_codec_round_trips_plain_and_nested_tensors():
    nested = torch.nested.as_nested_tensor([torch.tensor([1, 2]), torch.tensor([3])], layout=torch.jagged)
    td = TensorDict({"a": torch.arange(6).reshape(2, 3), "j": nested}, batch_size=[2])
    size, device, items = serialize_tensordict(td)
    assert (size, device, len(items["a"]), items["j"][0]) == ((2,), None, 3, "jagged")
    back = deserialize_tensordict((size, device, items))
    assert back["a"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert [t.tolist() for t in back["j"].unbind()] == [[1, 2], [3]]


def test_from_dict_takes_no_tensors_and_auto_padding_allows_unequal_chunks():
    only_objects = DataProto.from_dict(non_tensors={"uid": ["a", "b", "c"]})
    assert len(only_objects) == 3 and list(only_objects.batch.keys()) == []
    padded = DataProto.from_dict({"x": torch.arange(5)}, auto_padding=True)
    assert padded.is_padding_enabled()
    assert [p.batch["x"].tolist() for p in padded.chunk(3)] == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="not divisible"):
        DataProto.from_dict({"x": torch.arange(5)}).chunk(3)


def test_from_dict_takes_verls_positional_arguments():
    """verl: from_dict(tensors, non_tensors, meta_info, num_batch_dims, auto_padding)."""
    data = DataProto.from_dict({"x": torch.arange(5)}, None, {"k": 1}, 1, True)
    assert data.meta_info["k"] == 1 and data.is_padding_enabled()
    assert [len(p) for p in data.chunk(2)] == [3, 2]
    assert not DataProto.from_dict({"x": torch.arange(4)}, None, None, 1).is_padding_enabled()
    with pytest.raises(ValueError, match="num_batch_dims=2"):
        DataProto.from_dict({"x": torch.zeros(2, 3)}, num_batch_dims=2)


def test_data_proto_config_auto_padding_is_process_wide_and_read_from_the_env(monkeypatch):
    assert DataProtoConfig.auto_padding is False
    monkeypatch.setenv("VERL_AUTO_PADDING", "1")
    assert DataProtoConfig.auto_padding is True and batch(5).chunk(2)[1].batch["x"].shape[0] == 2
    monkeypatch.delenv("VERL_AUTO_PADDING")
    DataProtoConfig.auto_padding = True
    try:
        assert batch(3).is_padding_enabled()
    finally:
        DataProtoConfig.auto_padding = False
    with pytest.raises(TypeError):
        DataProtoConfig.auto_padding = 1


def test_padding_repeats_the_last_or_first_row_in_place():
    data = batch(2)
    data.padding(2)
    assert data.batch["x"].tolist() == [[0, 1], [2, 3], [2, 3], [2, 3]]
    assert data.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u1", "u1"]
    data = batch(2)
    data.padding(1, padding_candidate="first")
    assert data.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u0"]


def test_make_iterator_yields_epochs_of_mini_batches_with_meta_info():
    data = batch(4)
    parts = list(data.make_iterator(mini_batch_size=2, epochs=2))
    assert [p.non_tensor_batch["uid"].tolist() for p in parts] == [["u0", "u1"], ["u2", "u3"]] * 2
    assert all(p.meta_info == {"step": 3} for p in parts)
    shuffled = [
        p.batch["x"][:, 0].tolist() for p in data.make_iterator(2, 1, seed=1, dataloader_kwargs={"shuffle": True})
    ]
    again = [p.batch["x"][:, 0].tolist() for p in data.make_iterator(2, 1, seed=1, dataloader_kwargs={"shuffle": True})]
    assert shuffled == again and sorted(sum(shuffled, [])) == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="not divisible"):
        data.make_iterator(3, 1)


def test_sample_level_repeat_repeats_each_row_its_own_count():
    for counts in ([2, 0, 1, 1], (2, 0, 1, 1), torch.tensor([2, 0, 1, 1]), np.array([2, 0, 1, 1])):
        out = batch(4).sample_level_repeat(counts)
        assert out.non_tensor_batch["uid"].tolist() == ["u0", "u0", "u2", "u3"]
        assert out.batch["x"][:, 0].tolist() == [0, 0, 4, 6] and out.meta_info == {"step": 3}
    with pytest.raises(TypeError):
        batch(2).sample_level_repeat(2)


def test_unfold_column_chunks_moves_column_groups_to_rows():
    data = DataProto.from_dict(
        {"g": torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), "p": torch.tensor([10, 20])},
        {"o": np.array([["a", "b"], ["c", "d"]], dtype=object)},
    )
    out = data.unfold_column_chunks(2, split_keys=["g", "o"])
    assert out.batch["g"].tolist() == [[1, 2], [3, 4], [5, 6], [7, 8]]
    assert out.batch["p"].tolist() == [10, 10, 20, 20]
    assert out.non_tensor_batch["o"].tolist() == [["a"], ["b"], ["c"], ["d"]]


def test_to_and_from_tensordict_round_trip():
    td = batch(2).to_tensordict()
    assert td["x"].tolist() == [[0, 1], [2, 3]]
    back = DataProto.from_tensordict(td)
    assert back.batch["x"].tolist() == [[0, 1], [2, 3]]
    assert back.non_tensor_batch["uid"].tolist() == ["u0", "u1"] and back.meta_info == {"step": 3}
