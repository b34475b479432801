"""fp8 codes with one scale per group of codes (shards/codec.py) against a float64 reference."""

import torch

from shards import decode_codes, encode_codes
from shards.format import FP8_E4M3_MAX


def decaying_codes(num_tokens: int = 32, rank: int = 40) -> torch.Tensor:
    """Codes ordered by variance as a projection gives them: the leading ones 1e7 times the tail (beyond
    e4m3's range of 448 / 2^-9 with subnormals)."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(num_tokens, rank, generator=g) * torch.logspace(3, -4, rank)


def test_each_group_of_codes_has_its_own_scale_and_the_tail_survives():
    codes = decaying_codes()
    group = 16  # 40 codes: groups of 16, 16 and 8
    encoded = encode_codes(codes, "fp8", group)
    assert encoded["codes"].shape == (32, 40) and encoded["codes"].dtype == torch.float8_e4m3fn
    assert encoded["code_scale"].shape == (32, 3) and encoded["code_scale"].dtype == torch.float32
    for j, (a, b) in enumerate(((0, 16), (16, 32), (32, 40))):
        want = codes[:, a:b].double().abs().amax(1) / FP8_E4M3_MAX
        torch.testing.assert_close(encoded["code_scale"][:, j].double(), want, rtol=1e-6, atol=0)
    decoded = decode_codes(encoded["codes"], encoded["code_scale"], group).double()
    tail = slice(32, 40)
    rel_tail = (decoded[:, tail] - codes[:, tail]).norm() / codes[:, tail].norm()
    assert rel_tail < 0.05, f"the tail group keeps its own precision: relative error {rel_tail:.3g}"
    # One scale per token (a single group) rounds that tail into fp8's subnormals: why codes are grouped.
    per_token = encode_codes(codes, "fp8", 40)
    flushed = decode_codes(per_token["codes"], per_token["code_scale"], 40).double()[:, tail]
    rel_flushed = (flushed - codes[:, tail]).norm() / codes[:, tail].norm()
    assert rel_flushed > 0.3, f"one scale per token: tail relative error {rel_flushed:.3g}"


def test_bf16_codes_are_stored_as_they_are():
    codes = decaying_codes()
    encoded = encode_codes(codes, "bf16", 16)
    assert list(encoded) == ["codes"] and torch.equal(encoded["codes"], codes.bfloat16())
    assert decode_codes(encoded["codes"], None, 16) is encoded["codes"]
