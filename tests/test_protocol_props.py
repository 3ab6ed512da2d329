"""Property tests of DataProto: splitting/joining identities, repeat layouts, exact pickling."""

import pickle

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto

SETTINGS = settings(max_examples=60, deadline=None)


def make(n: int) -> DataProto:
    """n rows whose every column encodes the row number."""
    rows = torch.arange(n)
    return DataProto.from_dict(
        {"x": rows[:, None] * 3 + torch.arange(3), "f": rows.float().bfloat16()},
        {"uid": [f"u{i}" for i in range(n)], "obj": [{"i": i} for i in range(n)]},
        {"temperature": 0.5},
    )


def rows_of(d: DataProto) -> list[int]:
    """The row numbers held by d, checked to agree across every column."""
    from_x = (d.batch["x"][:, 0] // 3).tolist()
    assert d.batch["x"].tolist() == [[3 * r, 3 * r + 1, 3 * r + 2] for r in from_x]
    assert d.batch["f"].tolist() == torch.tensor(from_x).float().bfloat16().tolist()
    assert d.non_tensor_batch["uid"].tolist() == [f"u{r}" for r in from_x]
    assert [o["i"] for o in d.non_tensor_batch["obj"]] == from_x
    return from_x


@SETTINGS
@given(n=st.integers(1, 70), workers=st.integers(1, 9))
def test_pad_chunk_concat_unpad_is_identity(n, workers):
    data = make(n)
    padded, pad = pad_dataproto_to_divisor(data, workers)
    assert len(padded) % workers == 0 and 0 <= pad < workers
    chunks = padded.chunk(workers)
    assert len({len(c) for c in chunks}) == 1
    back = unpad_dataproto(DataProto.concat(chunks), pad)
    assert rows_of(back) == list(range(n)) and back.meta_info == data.meta_info


@SETTINGS
@given(n=st.integers(0, 40), size=st.integers(1, 12))
def test_split_concat_is_identity(n, size):
    parts = make(n).split(size)
    assert all(len(p) == size for p in parts[:-1]) and len(parts[-1]) <= size
    assert rows_of(DataProto.concat(parts)) == list(range(n))


@SETTINGS
@given(n=st.integers(1, 20), times=st.integers(1, 5))
def test_repeat_interleaved_vs_tiled(n, times):
    data = make(n)
    assert rows_of(data.repeat(times, interleave=True)) == [r for r in range(n) for _ in range(times)]
    assert rows_of(data.repeat(times, interleave=False)) == [r for _ in range(times) for r in range(n)]


@SETTINGS
@given(perm=st.integers(1, 30).flatmap(lambda n: st.permutations(list(range(n)))))
def test_reorder_then_inverse_is_identity(perm):
    data = make(len(perm))
    data.reorder(perm)
    assert rows_of(data) == perm
    data.reorder(np.argsort(perm))
    assert rows_of(data) == list(range(len(perm)))


@SETTINGS
@given(st.data())
def test_select_idxs_matches_numpy(data):
    n = data.draw(st.integers(1, 30))
    idx = data.draw(st.lists(st.integers(-n, n - 1), max_size=40))
    mask = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    d = make(n)
    assert rows_of(d.select_idxs(idx)) == np.arange(n)[np.array(idx, dtype=np.int64)].tolist()
    assert rows_of(d[np.array(mask)]) == np.arange(n)[np.array(mask)].tolist()


@SETTINGS
@given(bits=st.lists(st.integers(-(2**15), 2**15 - 1), min_size=1, max_size=64))
def test_bf16_pickling_is_bit_exact(bits):
    """Every bf16 bit pattern (NaNs, infinities, subnormals, -0) survives pickling unchanged."""
    raw = torch.tensor(bits, dtype=torch.int16)
    data = DataProto.from_dict({"h": raw.view(torch.bfloat16)[:, None].repeat(1, 2)})
    back = pickle.loads(pickle.dumps(data, protocol=5))
    assert back.batch["h"].dtype == torch.bfloat16
    assert torch.equal(back.batch["h"].view(torch.int16), data.batch["h"].view(torch.int16))
