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
    right = tensor_fingerprint(t[:50, 7:], col_start=(7,), row_shape=(576,))  # bf16 / fp16: parities from col 7
    blocks = [tensor_fingerprint(t[:50, :7]), right, tensor_fingerprint(t[50:], 50)]
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


def test_hand_computed_value_of_2_byte_elements():
    # bf16 1.0 is 0x3F80, -2.0 is 0xC000: row 0 of [[1, -2, 1]] sums 0x3F80 + 0xC000 * 2^16 + 0x3F80 (mod 2^32)
    t = torch.tensor([[1.0, -2.0, 1.0], [0.0, 0.0, 1.0]], dtype=torch.bfloat16)
    g = row_weights(0, 2).tolist()
    rows = [0x3F80 + 0xC000 * 2**16 + 0x3F80, 0x3F80]
    assert tensor_fingerprint(t) == (g[0] * rows[0] + g[1] * rows[1]) % 2**32


def test_2_byte_pairs_and_the_element_wise_path_agree(w):
    t = w.bfloat16()
    flat = torch.cat([torch.zeros(1, dtype=torch.bfloat16), t.reshape(-1)])[1:].view(300, 576)  # odd storage offset
    assert flat.storage_offset() == 1 and tensor_fingerprint(flat) == tensor_fingerprint(t)
    odd = t[:, :575].contiguous()  # odd width: the element-wise path
    assert combine(tensor_fingerprint(odd), tensor_fingerprint(t[:, 575:], col_start=(575,), row_shape=(576,))) == (
        tensor_fingerprint(t)
    )


def test_blocks_of_a_3d_tensor_add_up_to_it():
    t = torch.randn(4, 5, 6).bfloat16()
    blocks = [
        (slice(0, 4), slice(0, 2), slice(0, 3)),
        (slice(0, 4), slice(0, 2), slice(3, 6)),
        (slice(0, 4), slice(2, 5), slice(0, 6)),
    ]
    prints = [tensor_fingerprint(t[b], 0, (b[1].start, b[2].start), (5, 6)) for b in blocks]
    assert combine(*prints) == tensor_fingerprint(t)


@pytest.mark.parametrize("col", [4, 5])  # the low and the high half of a 32-bit pair
def test_2_byte_elements_see_one_ulp_in_either_half(w, col):
    t = w.bfloat16()
    nudged = t.clone()
    nudged.view(torch.int16)[3, col] += 1  # the next bf16 away from 0
    assert tensor_fingerprint(nudged) != tensor_fingerprint(t)


def test_the_documented_blind_spot_an_exactly_doubled_fp32_tensor():
    # fingerprint.py's docstring: every word + 2^23, summed over 576 x 576 words, cancels modulo 2^32
    t = torch.randn(576, 576, generator=torch.Generator().manual_seed(1))
    assert tensor_fingerprint(t * 2) == tensor_fingerprint(t)
    assert tensor_fingerprint((t * 2).bfloat16()) != tensor_fingerprint(t.bfloat16())
