"""Weight fingerprints (hybridflow/parity/fingerprint.py): exact, split-invariant, sensitive to every bit."""

import pytest
import torch

from hybridflow.parity.fingerprint import combine, differing, fingerprints, row_weights, tensor_fingerprint


@pytest.fixture
def w() -> torch.Tensor:
    return torch.randn(300, 576, generator=torch.Generator().manual_seed(0))


def test_hand_computed_value():
    # one row of bits 0x3F800000 (1.0f) per element of a 1-D tensor: sum_i g(i) * 0x3F800000 mod 2^32
    g = [12_345 * 2 + 1, (1_000_003 + 12_345) * 2 + 1]
    assert row_weights(0, 2).tolist() == g
    assert tensor_fingerprint(torch.ones(2)) == sum(x * 0x3F800000 for x in g) % 2**32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_blocks_tiling_a_tensor_add_up_to_it(w, dtype):
    t = w.to(dtype)
    whole = tensor_fingerprint(t)
    assert combine(tensor_fingerprint(t[:100]), tensor_fingerprint(t[100:], row_offset=100)) == whole  # row shards
    assert combine(tensor_fingerprint(t[:, :288]), tensor_fingerprint(t[:, 288:])) == whole  # column shards
    blocks = [tensor_fingerprint(t[:50, :7]), tensor_fingerprint(t[:50, 7:]), tensor_fingerprint(t[50:], 50)]
    assert combine(*blocks) == whole  # ragged, unaligned blocks too


def test_sees_one_ulp_a_row_swap_and_a_cast(w):
    whole = tensor_fingerprint(w)
    nudged = w.clone()
    nudged[3, 5] = torch.nextafter(nudged[3, 5], torch.tensor(10.0))
    assert tensor_fingerprint(nudged) != whole
    assert tensor_fingerprint(w[[1, 0, *range(2, 300)]]) != whole
    assert tensor_fingerprint(w.bfloat16()) != tensor_fingerprint(w.half().bfloat16())
    assert tensor_fingerprint(w.t()) != whole  # same bits, other rows


def test_named_fingerprints_and_differences(w):
    sent = fingerprints({"a": w, "b": w[:10]})
    held = fingerprints({"a": w, "b": w[:10] * 2, "c": w})
    assert differing(sent, held) == ["b", "c"]
    assert differing(sent, sent) == []
