"""DataProto: construction, indexing, key operations, splitting/joining, files, display, collate."""

import os
import pickle

import numpy as np
import pytest
import torch

from hybridflow.protocol import (
    DataProto,
    DataProtoItem,
    collate_fn,
    pad_dataproto_to_divisor,
    unpad_dataproto,
)
from hybridflow.protocol.keys import META_METRICS, UID

META_TEMPERATURE = "temperature"  # any batch-wide meta_info value


def make(n: int = 6) -> DataProto:
    """A batch with int64, float32, bf16 and bool tensors, strings and dicts, and meta info."""
    return DataProto.from_dict(
        {
            "ids": torch.arange(n * 3).view(n, 3),
            "logp": torch.linspace(-1, 0, n * 2).view(n, 2),
            "h": torch.randn(n, 4).bfloat16(),
            "mask": torch.arange(n) % 2 == 0,
        },
        {UID: [f"u{i}" for i in range(n)], "extra": [{"row": i, "tags": [i, i]} for i in range(n)]},
        {META_TEMPERATURE: 0.7},
    )


def assert_same(a: DataProto, b: DataProto) -> None:
    """Same keys, same tensor values and dtypes, same per-row objects, same meta_info."""
    assert len(a) == len(b)
    assert sorted(a.batch.keys()) == sorted(b.batch.keys())
    for key in a.batch.keys():
        assert a.batch[key].dtype == b.batch[key].dtype, key
        assert torch.equal(a.batch[key], b.batch[key]), key
    assert list(a.non_tensor_batch) == list(b.non_tensor_batch)
    for key, values in a.non_tensor_batch.items():
        assert values.dtype == object and b.non_tensor_batch[key].dtype == object
        assert values.tolist() == b.non_tensor_batch[key].tolist(), key
    assert a.meta_info == b.meta_info


# --- construction -------------------------------------------------------------------
def test_from_dict_builds_batch_object_arrays_and_meta():
    d = make(6)
    assert len(d) == 6 and d.batch.batch_size == torch.Size([6])
    assert d.non_tensor_batch[UID].dtype == object and d.non_tensor_batch[UID][2] == "u2"
    # equal-length lists stay one object per row instead of becoming a 2-D array
    d2 = DataProto.from_dict({}, {"pairs": [[1, 2], [3, 4]]})
    assert d2.non_tensor_batch["pairs"].shape == (2,) and d2.non_tensor_batch["pairs"][1] == [3, 4]
    assert d.meta_info == {META_TEMPERATURE: 0.7}


def test_from_single_dict_splits_tensors_from_other_values():
    d = DataProto.from_single_dict(
        {"x": torch.zeros(3, 2), "s": np.array(["a", "b", "c"]), "l": ["p", "q", "r"]}, meta_info={"k": 1}
    )
    assert list(d.batch.keys()) == ["x"]
    assert set(d.non_tensor_batch) == {"s", "l"}
    assert all(v.dtype == object for v in d.non_tensor_batch.values())
    assert d.meta_info == {"k": 1}


def test_empty_and_meta_only_dataproto():
    d = DataProto(meta_info={"n": 2})
    assert len(d) == 0 and d.meta_info == {"n": 2}
    assert [len(c) for c in d.chunk(3)] == [0, 0, 0]
    assert DataProto.from_dict({}, {"s": ["a", "b"]}).batch.batch_size == torch.Size([2])


def test_length_mismatch_between_keys_names_keys_and_sizes():
    with pytest.raises(ValueError, match=r"different batch sizes.*'a': 3.*'b': 4"):
        DataProto.from_dict({"a": torch.zeros(3), "b": torch.zeros(4)})
    with pytest.raises(ValueError, match=r"'s': 2"):
        DataProto.from_dict({"a": torch.zeros(3)}, {"s": ["x", "y"]})
    with pytest.raises(ValueError, match=r"non_tensor_batch lengths \{'s': 2\} differ from the batch size 3"):
        DataProto(make(3).batch, {"s": ["x", "y"]})


def test_batch_wide_value_in_non_tensors_is_rejected():
    with pytest.raises(ValueError, match=r"non_tensors\['tag'\].*meta_info"):
        DataProto.from_dict({"a": torch.zeros(3)}, {"tag": "abc"})
    with pytest.raises(ValueError, match="one batch dimension"):
        DataProto(batch={"a": torch.zeros(3)})


# --- indexing -------------------------------------------------------------------------
def test_int_index_gives_one_row_item():
    d = make(5)
    item = d[2]
    assert isinstance(item, DataProtoItem)
    assert torch.equal(item.batch["ids"], torch.tensor([6, 7, 8]))
    assert item.non_tensor_batch[UID] == "u2" and item.meta_info == d.meta_info
    assert d[-1].non_tensor_batch[UID] == "u4" and d[np.int64(1)].non_tensor_batch[UID] == "u1"
    with pytest.raises(IndexError, match="index 5 out of range for length 5"):
        d[5]
    with pytest.raises(TypeError, match="str"):
        d["ids"]


@pytest.mark.parametrize(
    "index",
    [
        slice(1, 4),
        torch.tensor([4, 0, 2]),
        np.array([4, 0, 2]),
        [4, 0, 2],
        torch.tensor([True, False, True, False, True]),
        np.array([True, False, True, False, True]),
    ],
)
def test_slice_and_index_arrays_match_numpy_indexing(index):
    d = make(5)
    expected = np.arange(5)[np.asarray(index) if not isinstance(index, slice) else index]
    part = d[index]
    assert isinstance(part, DataProto)
    assert part.non_tensor_batch[UID].tolist() == [f"u{i}" for i in expected]
    assert torch.equal(part.batch["ids"], d.batch["ids"][torch.as_tensor(expected)])
    assert torch.equal(part.batch["h"], d.batch["h"][torch.as_tensor(expected)])


def test_slice_with_step_and_select_idxs_bad_mask():
    d = make(6)
    assert d.slice(1, 6, 2).non_tensor_batch[UID].tolist() == ["u1", "u3", "u5"]
    assert len(d.select_idxs([])) == 0
    with pytest.raises(ValueError, match=r"bool mask of shape \(4,\) does not match the batch size 6"):
        d.select_idxs(torch.ones(4, dtype=torch.bool))


# --- key operations ------------------------------------------------------------------
def test_select_keeps_named_keys_and_shares_or_copies():
    d = make(4)
    s = d.select(["ids"], [UID], [])
    assert list(s.batch.keys()) == ["ids"] and list(s.non_tensor_batch) == [UID] and s.meta_info == {}
    assert_same(d.select(), d)
    s.batch["ids"][0, 0] = 100  # shallow select shares tensors
    assert d.batch["ids"][0, 0] == 100
    deep = d.select(["ids"], ["extra"], deepcopy=True)
    deep.batch["ids"][0, 0] = -1
    deep.non_tensor_batch["extra"][0]["row"] = -1
    assert d.batch["ids"][0, 0] == 100 and d.non_tensor_batch["extra"][0]["row"] == 0


def test_select_and_pop_unknown_keys_raise_keyerror_naming_them():
    d = make(2)
    with pytest.raises(KeyError, match=r"DataProto.batch has no key\(s\) \['nope'\]; present keys"):
        d.select(batch_keys=["ids", "nope"])
    with pytest.raises(KeyError, match=r"non_tensor_batch has no key\(s\) \['x'\]"):
        d.pop(non_tensor_batch_keys=["x"])
    with pytest.raises(KeyError, match=r"meta_info has no key\(s\) \['m'\]"):
        d.select(meta_info_keys="m")
    assert sorted(d.batch.keys()) == ["h", "ids", "logp", "mask"]  # a failed pop removed nothing


def test_pop_removes_and_returns():
    d = make(3)
    popped = d.pop(batch_keys=["logp", "h"], non_tensor_batch_keys=[UID], meta_info_keys=[META_TEMPERATURE])
    assert sorted(popped.batch.keys()) == ["h", "logp"] and list(popped.non_tensor_batch) == [UID]
    assert popped.meta_info == {META_TEMPERATURE: 0.7}
    assert sorted(d.batch.keys()) == ["ids", "mask"] and list(d.non_tensor_batch) == ["extra"]
    assert d.meta_info == {} and len(popped) == len(d) == 3


def test_rename_batch_and_non_tensor_keys():
    d = make(2)
    assert d.rename(["ids", UID], ["input_ids", "group"]) is d
    assert "input_ids" in d.batch.keys() and "ids" not in d.batch.keys()
    assert list(d.non_tensor_batch) == ["group", "extra"]
    d.rename("logp", "old_log_probs")
    assert "old_log_probs" in d.batch.keys()
    with pytest.raises(KeyError, match=r"no key\(s\) \['missing'\]"):
        d.rename("missing", "x")
    with pytest.raises(ValueError, match="1 old keys"):
        d.rename(["mask"], ["a", "b"])


def test_union_adds_keys_and_rejects_clashes():
    d = make(3)
    other = DataProto.from_dict({"ids": d.batch["ids"].clone(), "v": torch.ones(3)}, {"n": [1, 2, 3]}, {"k": 1})
    assert d.union(other) is d
    assert torch.equal(d.batch["v"], torch.ones(3)) and d.non_tensor_batch["n"].tolist() == [1, 2, 3]
    assert d.meta_info == {META_TEMPERATURE: 0.7, "k": 1}
    clash = DataProto.from_dict({"ids": torch.zeros(3, 3, dtype=torch.int64)})
    with pytest.raises(ValueError, match=r"batch\['ids'\] differs"):
        d.union(clash)
    with pytest.raises(ValueError, match=r"non_tensor_batch\['uid'\] differs"):
        d.union(DataProto.from_dict({}, {UID: ["a", "b", "c"]}))
    with pytest.raises(ValueError, match=r"meta_info\['temperature'\] differs"):
        d.union(DataProto.from_dict({}, {UID: d.non_tensor_batch[UID]}, {META_TEMPERATURE: 1.0}))
    with pytest.raises(ValueError, match=r"batch sizes differ \(3 vs 2\)"):
        d.union(make(2))


# --- splitting and joining -------------------------------------------------------------
def test_chunk_split_and_concat_round_trip():
    d = make(6)
    chunks = d.chunk(3)
    assert [c.non_tensor_batch[UID].tolist() for c in chunks] == [["u0", "u1"], ["u2", "u3"], ["u4", "u5"]]
    assert all(c.meta_info == d.meta_info for c in chunks)
    assert_same(DataProto.concat(chunks), d)
    parts = d.split(4)
    assert [len(p) for p in parts] == [4, 2]
    assert_same(DataProto.concat(parts), d)


def test_chunk_errors_suggest_padding():
    with pytest.raises(ValueError, match=r"batch size 5 is not divisible by 2 chunks.*pad_dataproto_to_divisor"):
        make(5).chunk(2)
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        make(5).chunk(0)
    with pytest.raises(ValueError, match="split_size must be >= 1"):
        make(5).split(0)


def test_concat_merges_meta_info():
    a, b = make(2), make(2)
    a.meta_info[META_METRICS] = {"loss": [0.5], "lr": 1e-5, "same": 3}
    b.meta_info[META_METRICS] = {"loss": [0.25, 0.125], "lr": 2e-5, "same": 3, "only_b": 1}
    merged = DataProto.concat([a, b]).meta_info
    assert merged[META_TEMPERATURE] == 0.7
    assert merged[META_METRICS] == {"loss": [0.5, 0.25, 0.125], "lr": [1e-5, 2e-5], "same": 3, "only_b": 1}
    b.meta_info[META_TEMPERATURE] = 1.0
    with pytest.raises(ValueError, match=r"meta_info\['temperature'\] differs between parts"):
        DataProto.concat([a, b])


def test_concat_rejects_mismatched_keys_and_empty_list():
    a, b = make(2), make(2)
    b.pop(batch_keys=["h"])
    with pytest.raises(ValueError, match=r"part 1 has keys \['ids', 'logp', 'mask'\]"):
        DataProto.concat([a, b])
    wide = DataProto.from_dict({"r": torch.zeros(2, 5)})
    with pytest.raises(ValueError, match=r"batch\['r'\] is torch.float32 \[2, 5\] in part 1 but .* \[2, 3\]"):
        DataProto.concat([DataProto.from_dict({"r": torch.zeros(2, 3)}), wide])
    with pytest.raises(ValueError, match="empty list"):
        DataProto.concat([])


def test_repeat_interleaved_and_tiled():
    d = make(3)
    assert d.repeat(2).non_tensor_batch[UID].tolist() == ["u0", "u0", "u1", "u1", "u2", "u2"]
    tiled = d.repeat(2, interleave=False)
    assert tiled.non_tensor_batch[UID].tolist() == ["u0", "u1", "u2", "u0", "u1", "u2"]
    assert torch.equal(tiled.batch["h"], torch.cat([d.batch["h"], d.batch["h"]]))


def test_reorder_in_place_and_rejects_non_permutation():
    d = make(4)
    assert d.reorder(torch.tensor([3, 1, 0, 2])) is None
    assert d.non_tensor_batch[UID].tolist() == ["u3", "u1", "u0", "u2"]
    assert d.batch["ids"][:, 0].tolist() == [9, 3, 0, 6]
    with pytest.raises(ValueError, match=r"permutation of range\(4\)"):
        d.reorder([0, 0, 1, 2])


def test_to_moves_in_place():
    d = make(2)
    assert d.to("cpu") is d and d.batch.device == torch.device("cpu")


# --- padding -------------------------------------------------------------------------------
def test_pad_repeats_rows_from_the_start_and_unpad_restores():
    d = make(3)
    padded, pad = pad_dataproto_to_divisor(d, 8)
    assert pad == 5 and len(padded) == 8
    assert padded.non_tensor_batch[UID].tolist() == ["u0", "u1", "u2", "u0", "u1", "u2", "u0", "u1"]
    assert_same(unpad_dataproto(padded, pad), d)
    same, zero = pad_dataproto_to_divisor(d, 3)
    assert same is d and zero == 0 and unpad_dataproto(d, 0) is d
    with pytest.raises(ValueError, match=r"pad_size 4 is outside \[0, 3\]"):
        unpad_dataproto(d, 4)
    with pytest.raises(ValueError, match="size_divisor must be >= 1"):
        pad_dataproto_to_divisor(d, 0)


# --- files, pickling, display ---------------------------------------------------------------
def test_save_and_load_round_trip_atomically(tmp_path):
    d = make(4)
    path = tmp_path / "sub" / "batch.pkl"
    d.save_to_disk(path)
    make(1).save_to_disk(path)  # overwrite through os.replace
    d.save_to_disk(str(path))
    assert_same(DataProto.load_from_disk(path), d)
    assert os.listdir(path.parent) == ["batch.pkl"]  # no temporary file left behind
    with open(tmp_path / "other.pkl", "wb") as f:
        pickle.dump({"not": "a dataproto"}, f)
    with pytest.raises(TypeError, match="holds a dict, not a DataProto"):
        DataProto.load_from_disk(tmp_path / "other.pkl")


def test_pickle_round_trip_keeps_dtypes_values_and_writability():
    d = make(5)
    d.batch["f8"] = torch.randn(5).to(torch.float8_e4m3fn)
    d.batch["u16"] = torch.arange(5, dtype=torch.int16)
    back = pickle.loads(pickle.dumps(d))
    for key in d.batch.keys():
        assert back.batch[key].dtype == d.batch[key].dtype, key
        assert torch.equal(back.batch[key].view(torch.uint8), d.batch[key].view(torch.uint8)), key
    assert_same(back.select(batch_keys=["ids", "logp", "mask"]), d.select(batch_keys=["ids", "logp", "mask"]))
    back.batch["ids"] += 1  # unpickled tensors are ordinary writable tensors
    assert torch.equal(back.batch["ids"], d.batch["ids"] + 1)


def test_pickle_ships_each_tensor_once_out_of_band():
    d = DataProto.from_dict({"a": torch.zeros(64, 128), "b": torch.ones(64, 32, dtype=torch.bfloat16)})
    buffers = []
    header = pickle.dumps(d, protocol=5, buffer_callback=buffers.append)
    assert sorted(b.raw().nbytes for b in buffers) == [64 * 32 * 2, 64 * 128 * 4]
    assert len(header) < 2000  # no per-element objects in-band
    view = d[:4]  # a slice ships only its own rows, not the whole storage
    buffers.clear()
    pickle.dumps(view, protocol=5, buffer_callback=buffers.append)
    assert sorted(b.raw().nbytes for b in buffers) == [4 * 32 * 2, 4 * 128 * 4]


def test_summary_print_size_and_repr(capsys):
    d = make(3)
    text = d.summary()
    for part in [
        "3 rows",
        "batch['ids']: int64 [3, 3]",
        "batch['h']: bfloat16 [3, 4]",
        "bool",
        "non_tensor_batch['uid']: object [3] of str",
        "meta_info keys: ['temperature']",
        "MiB",
    ]:
        assert part in text, part
    assert d.print_size() == text and text in capsys.readouterr().out
    assert repr(d).startswith("DataProto(len=3, batch={ids: int64[3, 3]") and "uid" in repr(d)


# --- collate ------------------------------------------------------------------------------------
def test_collate_fn_stacks_tensors_and_wraps_the_rest():
    rows = [{"ids": torch.tensor([i, i]), "text": f"t{i}", "info": {"i": i}} for i in range(3)]
    d = collate_fn(rows)
    assert torch.equal(d.batch["ids"], torch.tensor([[0, 0], [1, 1], [2, 2]]))
    assert d.non_tensor_batch["text"].tolist() == ["t0", "t1", "t2"]
    assert d.non_tensor_batch["info"][2] == {"i": 2}
    with pytest.raises(KeyError, match=r"row 1 has keys \['ids'\] but row 0 has \['ids', 'x'\]"):
        collate_fn([{"ids": torch.zeros(2), "x": 1}, {"ids": torch.zeros(2)}])
    with pytest.raises(ValueError, match=r"tensors under 'ids' have different shapes"):
        collate_fn([{"ids": torch.zeros(2)}, {"ids": torch.zeros(3)}])
    with pytest.raises(ValueError, match="no rows"):
        collate_fn([])
