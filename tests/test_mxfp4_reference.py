"""The MXFP4 reference (model_ops.quant.mxfp4) against amd-quark, bit for bit, on CPU.

amd-quark is the tool that writes the released checkpoints; its packing (Pack_fp4), its "even"
scale rule (even_round) and its fake-quantize kernel are the ground truth for the format and
for the emulated MXFP4 activations.
"""
from __future__ import annotations

import pytest
import torch

from model_ops.quant.mxfp4 import (E2M1_VALUES, dequantize_mxfp4, e8m0_to_float32, pack_e2m1, qdq_mxfp4,
                                   quantize_mxfp4, unpack_e2m1)

quark_utils = pytest.importorskip("quark.torch.quantization.utils")
quark_pack = pytest.importorskip("quark.torch.utils.pack")
quark_emul = pytest.importorskip("quark.torch.kernel.hw_emulation.hw_emulation_interface")


def _inputs(seed: int) -> torch.Tensor:
    """Random rows at very different magnitudes, plus rows that hit the edges: ties between
    E2M1 values, amax exactly at and just under the 1.75 * 2^n rounding point, an all-zero block,
    tiny (subnormal-scale) and huge blocks."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(8, 256, generator=g) * 10.0 ** torch.randint(-6, 6, (8, 1), generator=g)]
    grid = torch.tensor([v for v in E2M1_VALUES if v >= 0])
    ties = (grid[:-1] + grid[1:]) / 2
    tie_row = torch.cat([ties, -ties, grid, torch.full((32 - 2 * len(ties) - len(grid),), 6.0)])
    rows.append(torch.cat([tie_row * 2.0 ** e for e in (-3, 0, 5, 20, -30, 40, 1, 2)]).view(1, 256))
    edge = torch.randn(256, generator=g).clamp(-1, 1)
    edge[0:32] = edge[0:32] / edge[0:32].abs().max() * 1.75  # amax at the round-up point
    edge[32:64] = edge[32:64] / edge[32:64].abs().max() * torch.tensor(1.75).nextafter(torch.tensor(0.0))
    edge[64:96] = 0.0
    edge[96:128] *= 1e-39
    edge[128:160] *= 3e38
    rows.append(edge.view(1, 256))
    return torch.cat(rows)


def _quark_qdq(x: torch.Tensor) -> torch.Tensor:
    scale = quark_utils.even_round(x.unflatten(-1, (-1, 32)).abs().amax(-1), "fp4")
    return quark_emul.fake_quantize_fp4_fp6_per_group_with_scale(x, scale, -1, 32, "fp4")


@pytest.mark.parametrize("seed", [0, 1])
def test_qdq_matches_amd_quark(seed):
    x = _inputs(seed)
    ours, theirs = qdq_mxfp4(x), _quark_qdq(x)
    assert torch.equal(ours, theirs), (ours - theirs).abs().max()
    assert torch.equal(torch.signbit(ours), torch.signbit(theirs))


def test_scales_match_quark_even_round():
    x = _inputs(2)
    _, scale = quantize_mxfp4(x)
    expected = quark_utils.even_round(x.unflatten(-1, (-1, 32)).abs().amax(-1), "fp4")
    assert torch.equal(e8m0_to_float32(scale), expected)


def test_packing_matches_quark_pack_fp4():
    x = _inputs(3)[:-1]  # the edge row's 3e38 block dequantizes to inf, which has no E2M1 code to compare
    packed, scale = quantize_mxfp4(x)
    codes_as_values = qdq_mxfp4(x).unflatten(-1, (-1, 32)) / e8m0_to_float32(scale)[..., None]
    expected = quark_pack.Pack_fp4(None, "fp4").pack(codes_as_values.flatten(-2), reorder=False)
    assert torch.equal(packed, expected)
    assert torch.equal(quark_pack.Pack_fp4(None, "fp4").unpack(packed, reorder=False), codes_as_values.flatten(-2))


def test_e8m0_edges_are_exact():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = e8m0_to_float32(b)
    assert got[0].item() == 2.0 ** -127 and got[0].item() > 0  # a subnormal, not flushed to zero
    assert got[254].item() == 2.0 ** 127 and got[127].item() == 1.0
    assert torch.isnan(got[255])
    assert torch.equal(got[1:255], torch.tensor([2.0 ** (i - 127) for i in range(1, 255)]))


def test_dequantize_layout_first_element_low_nibble():
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert torch.equal(packed[:, 0], codes[:, 0] | (codes[:, 1] << 4))
    assert torch.equal(unpack_e2m1(packed), codes)
    scale = torch.randint(100, 150, (3, 2), dtype=torch.uint8)
    values = dequantize_mxfp4(packed, scale)
    table = torch.tensor(E2M1_VALUES)
    assert torch.equal(values, table[codes.long()] * e8m0_to_float32(scale).repeat_interleave(32, -1))


def test_non_finite_blocks_get_the_nan_scale():
    x = torch.randn(2, 64)
    x[0, 3], x[1, 40] = float("nan"), float("inf")
    _, scale = quantize_mxfp4(x)
    assert scale[0, 0] == 255 and scale[1, 1] == 255 and scale[0, 1] != 255 and scale[1, 0] != 255


def test_shape_errors_name_the_problem():
    with pytest.raises(ValueError, match="blocks of 32"):
        quantize_mxfp4(torch.randn(2, 48))
    with pytest.raises(ValueError, match="disagree"):
        dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(torch.zeros(2, 16), torch.zeros(2, 1, dtype=torch.uint8))
