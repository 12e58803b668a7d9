"""fp8 (e4m3) codec: half the bytes, a proven error bound, exact zeros and extremes, the scales
it promises, one-slot packing; the CUDA kernels write exactly the reference's bytes.

The error bound, per element x of a group with scale s (s = amax/448 rounded to fp32), output
dtype with unit roundoff u (fp16 2^-11, bf16 2^-8, fp32 2^-24) and r = 2^-24 (fp32):
  q = fl32(x/s):           |q - x/s| <= r·|x/s| (+ 2^-150 if q underflows fp32)
  e = e4m3_rne_sat(q):     |e - q| <= |q|/17 + 2^-10
      Normal e4m3 (|q| >= 2^-6) has 3 mantissa bits: in [2^k, 2^(k+1)) the grid step is
      2^(k-3), so the error is at most 2^(k-4), reached at the first midpoint 2^k·17/16 and
      relatively smaller elsewhere: ratio <= 1/17 (< 2^-4). Subnormals (|q| < 2^-6) have step
      2^-9: error <= 2^-10 absolute. Saturation: |x/s| <= 448(1+r)/(1-r), so the clamp to
      448 costs less than 1/17 too.
  z = fl32(e·s):           |z - e·s| <= r·|e·s| + 2^-150
  y = dtype(z):            |y - z| <= u·|z| + η_dtype (half the dtype's smallest subnormal)
Summing, with |e·s| <= |x|(18/17 + 2r) + s·2^-10:
  |x - y| <= |x|·(1/17 + 2u + 2^-22) + s·2^-9 + η,   η = η_dtype + 2^-149.
For fp16 this is tighter than |x|·2^-4 + s·2^-9 except for η: when the group's amax is tiny,
outputs are fp16 subnormals and their rounding (2^-25) exceeds s·2^-9 (see
test_fp16_subnormal_outputs_need_the_eta_term). For bf16, 1/17 + 2^-7 > 2^-4: the output
rounding alone can push the relative error past 2^-4 (we measured up to 0.0617).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtierd.errors import InvalidArgument
from kvtierd.layout import llama3_8b
from kvtierd.movers.fp8_codec import (
    dequantize_fp8,
    dequantize_fp8_reference,
    fp8_slot_nbytes,
    pack_fp8_slot,
    quantize_fp8,
    quantize_fp8_reference,
    unpack_fp8_slot,
)
from tests.factories import small_layout

UNIT_ROUNDOFF = {torch.float16: 2**-11, torch.bfloat16: 2**-8, torch.float32: 2**-24}
HALF_SMALLEST_SUBNORMAL = {torch.float16: 2**-25, torch.bfloat16: 2**-134, torch.float32: 2**-150}
CODEC_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def error_bound(x: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The derived per-element bound (module docstring), in float64."""
    s = scales.double()[..., None, None, None].expand(x.shape)
    eta = HALF_SMALLEST_SUBNORMAL[dtype] + 2**-149
    return x.double().abs() * (1 / 17 + 2 * UNIT_ROUNDOFF[dtype] + 2**-22) + s * 2**-9 + eta


def random_blocks(shape=(3, 2, 2, 4, 2, 8), dtype=torch.float16, seed=0) -> torch.Tensor:
    """Normal values, each group scaled by its own 10^U(-3, 3): scales differ group to group."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator, dtype=torch.float64)
    magnitudes = 10 ** (torch.rand(shape[:3], generator=generator, dtype=torch.float64) * 6 - 3)
    return (values * magnitudes[..., None, None, None]).to(dtype)


def round_trip(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    payload, scales = quantize_fp8(blocks)
    return payload, scales, dequantize_fp8(payload, scales, blocks.dtype)


def test_payload_is_half_of_fp16_and_slot_adds_only_scales():
    blocks = random_blocks()
    payload, scales = quantize_fp8(blocks)
    assert payload.dtype == torch.uint8 and payload.shape == blocks.shape
    assert payload.nbytes * 2 == blocks.nbytes
    assert scales.dtype == torch.float32 and scales.shape == (3, 2, 2)
    llama = llama3_8b()
    assert fp8_slot_nbytes(llama) == llama.bytes_per_block // 2 + 32 * 2 * 4  # 1 MiB + 256 B
    assert fp8_slot_nbytes(small_layout()) == 256 + 2 * 2 * 4


@pytest.mark.parametrize("dtype", CODEC_DTYPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_round_trip_error_within_derived_bound(dtype, seed):
    blocks = random_blocks((4, 3, 2, 4, 2, 16), dtype, seed)
    _, scales, restored = round_trip(blocks)
    error = (blocks.double() - restored.double()).abs()
    assert (error <= error_bound(blocks, scales, dtype)).all()
    relative = error / blocks.double().abs().clamp_min(1e-30)
    assert relative.max() > 0.03  # the codec does lose precision: the test sees real rounding


def test_fp16_subnormal_outputs_need_the_eta_term():
    """A tiny group: outputs are fp16 subnormals; |x|·2^-4 + s·2^-9 alone does not hold."""
    steps = torch.arange(1, 129, dtype=torch.float64) * 2**-24  # fp16 subnormals
    blocks = steps.to(torch.float16).view(1, 1, 1, 128, 1, 1).expand(1, 1, 2, 128, 1, 1).contiguous()
    _, scales, restored = round_trip(blocks)
    error = (blocks.double() - restored.double()).abs()
    naive = blocks.double().abs() * 2**-4 + scales.double().max() * 2**-9
    assert (error > naive).any()
    assert (error <= error_bound(blocks, scales, torch.float16)).all()


def test_rounding_is_nearest_even_with_subnormals_and_saturation():
    """With scale 1 (amax 448): ties go to the even code, below 2^-6 the step is 2^-9."""
    values = [448.0, 1.0625, 1.1875, 3 * 2**-10, 2**-10, -448.0, 1.0, -2**-9]
    codes = [0x7E, 0x38, 0x3A, 0x02, 0x00, 0xFE, 0x38, 0x81]
    blocks = torch.tensor(values, dtype=torch.float32).view(1, 1, 1, 8, 1, 1).expand(1, 1, 2, 8, 1, 1)
    payload, scales = quantize_fp8(blocks.contiguous())
    assert scales.flatten().tolist() == [1.0, 1.0]
    assert payload[0, 0, 0].flatten().tolist() == codes


@pytest.mark.parametrize("dtype", CODEC_DTYPES)
def test_zeros_stay_zero(dtype):
    blocks = random_blocks(dtype=dtype)
    blocks[0] = 0  # whole groups of zeros
    blocks[1, :, :, 1] = 0  # zeros inside non-zero groups
    payload, scales, restored = round_trip(blocks)
    assert (scales[0] == 1.0).all() and (payload[0] == 0).all()
    assert (restored[0] == 0).all() and (restored[1, :, :, 1] == 0).all()


@pytest.mark.parametrize("dtype", CODEC_DTYPES)
def test_amax_maps_to_plus_minus_448_times_scale_exactly(dtype):
    blocks = random_blocks(dtype=dtype, seed=3)
    payload, scales, restored = round_trip(blocks)
    groups = blocks.reshape(3, 2, 2, -1)
    positions = groups.float().abs().argmax(dim=-1, keepdim=True)
    signs = torch.gather(groups, -1, positions).float().sign()
    codes = torch.gather(payload.reshape(3, 2, 2, -1), -1, positions)
    assert torch.equal(codes, torch.where(signs > 0, 0x7E, 0xFE).to(torch.uint8))
    expected = (signs * 448 * scales[..., None]).to(dtype)  # one fp32 product, then the cast
    assert torch.equal(torch.gather(restored.reshape(3, 2, 2, -1), -1, positions), expected)


def test_scales_have_the_promised_values():
    """scale = fl32(amax / 448) per (block, layer, K/V), 1.0 for an all-zero group."""
    amax = np.array([[[448.0, 0.0], [1.0, 3.0]], [[448.0 * 2**-7, 65504.0], [0.1, 7e-5]]],
                    dtype=np.float32)
    blocks = torch.zeros(2, 2, 2, 4, 2, 8, dtype=torch.float32)
    blocks[..., 1, 1, 3] = -torch.from_numpy(amax)  # amax sits at a negative element
    blocks[..., 0, 0, 0] = torch.from_numpy(amax) / 2
    expected = np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0))
    _, scales = quantize_fp8(blocks)
    assert np.array_equal(scales.numpy(), expected)
    assert scales[0, 0, 0] == 1.0 and scales[1, 0, 0] == 2**-7 and scales[0, 0, 1] == 1.0


def test_scale_is_a_true_division_not_a_reciprocal_multiply():
    """For many amax values fl(a/448) != fl(a·fl(1/448)); the codec must give the former."""
    amax = torch.from_numpy(np.random.default_rng(5).uniform(1, 2, 512).astype(np.float32))
    blocks = torch.zeros(512, 1, 2, 1, 1, 2, dtype=torch.float32)
    blocks[:, 0, :, 0, 0, 1] = amax[:, None]
    _, scales = quantize_fp8(blocks)
    true_quotient = amax.numpy() / np.float32(448.0)
    reciprocal = amax.numpy() * (np.float32(1.0) / np.float32(448.0))
    assert (true_quotient != reciprocal).any()
    assert np.array_equal(scales[:, 0, 0].numpy(), true_quotient)


@pytest.mark.parametrize("dtype", CODEC_DTYPES)
def test_dequantize_to_each_dtype_rounds_one_fp32_product(dtype):
    payload, scales = quantize_fp8(random_blocks(seed=4))
    expected = (payload.view(torch.float8_e4m3fn).float() * scales[..., None, None, None]).to(dtype)
    assert torch.equal(dequantize_fp8(payload, scales, dtype), expected)


@pytest.mark.parametrize("layout", [small_layout(), small_layout(block_size=1, num_layers=1,
                                                                  num_kv_heads=1, head_dim=1)],
                         ids=["small", "2-byte payload"])
def test_pack_unpack_round_trips_one_slot_per_block(layout):
    blocks = random_blocks((5, *layout.block_shape), seed=6)
    payload, scales = quantize_fp8(blocks)
    slots = pack_fp8_slot(payload, scales)
    assert slots.dtype == torch.uint8 and slots.shape == (5, fp8_slot_nbytes(layout))
    payload_nbytes = payload[0].numel()
    assert torch.equal(slots[:, :payload_nbytes], payload.reshape(5, -1))  # payload first
    scales_offset = -(-payload_nbytes // 4) * 4
    assert (slots[:, payload_nbytes:scales_offset] == 0).all()  # zero padding
    unpacked_payload, unpacked_scales = unpack_fp8_slot(slots, layout)
    assert torch.equal(unpacked_payload, payload) and torch.equal(unpacked_scales, scales)
    assert torch.equal(dequantize_fp8(unpacked_payload, unpacked_scales, torch.float16),
                       dequantize_fp8(payload, scales, torch.float16))


def test_unpack_accepts_slots_at_an_unaligned_offset():
    layout = small_layout()
    slots = pack_fp8_slot(*quantize_fp8(random_blocks()))
    buffer = torch.zeros(slots.numel() + 1, dtype=torch.uint8)
    buffer[1:] = slots.flatten()
    payload, scales = unpack_fp8_slot(buffer[1:].view(slots.shape), layout)
    assert torch.equal(scales, unpack_fp8_slot(slots, layout)[1])


def test_public_api_matches_reference_on_cpu():
    blocks = random_blocks(dtype=torch.bfloat16, seed=7)
    payload, scales = quantize_fp8(blocks)
    ref_payload, ref_scales = quantize_fp8_reference(blocks)
    assert torch.equal(payload, ref_payload) and torch.equal(scales, ref_scales)
    assert torch.equal(dequantize_fp8(payload, scales, torch.bfloat16),
                       dequantize_fp8_reference(payload, scales, torch.bfloat16))


@pytest.mark.parametrize("call", [
    lambda: quantize_fp8(torch.zeros(1, 2, 2, 4, 2, 8, dtype=torch.int32)),
    lambda: quantize_fp8(torch.zeros(1, 2, 2, 4, 2, 8, dtype=torch.float8_e4m3fn)),
    lambda: quantize_fp8(torch.zeros(2, 2, 4, 2, 8, dtype=torch.float16)),
    lambda: quantize_fp8(torch.zeros(1, 2, 3, 4, 2, 8, dtype=torch.float16)),
    lambda: quantize_fp8(torch.zeros(1, 2, 2, 0, 2, 8, dtype=torch.float16)),
    lambda: dequantize_fp8(torch.zeros(1, 2, 2, 4, 2, 8, dtype=torch.uint8), torch.ones(1, 2), torch.float16),
    lambda: dequantize_fp8(torch.zeros(1, 2, 2, 4, 2, 8, dtype=torch.uint8),
                           torch.ones(1, 2, 2, dtype=torch.float64), torch.float16),
    lambda: dequantize_fp8(torch.zeros(1, 2, 2, 4, 2, 8, dtype=torch.uint8), torch.ones(1, 2, 2),
                           torch.float8_e4m3fn),
    lambda: dequantize_fp8(torch.zeros(1, 2, 2, 4, 2, 8, dtype=torch.uint8),
                           torch.ones(1, 2, 2, device="meta"), torch.float16),
    lambda: unpack_fp8_slot(torch.zeros(1, 271, dtype=torch.uint8), small_layout()),
    lambda: unpack_fp8_slot(torch.zeros(1, 272, dtype=torch.int8), small_layout()),
], ids=["int input", "fp8 input", "5-d", "kv dim 3", "empty group", "scales shape", "scales dtype",
        "output dtype", "scales device", "slot size", "slot dtype"])
def test_bad_inputs_raise_invalid_argument(call):
    with pytest.raises(InvalidArgument):
        call()


# --- CUDA: the kernels write exactly the reference's bytes ---------------------------------

GPU_SHAPES = [(3, 2, 2, 4, 2, 8), (5, 4, 2, 16, 8, 128), (2, 1, 2, 5, 3, 67)]  # 1005-element groups


def cuda_blocks(shape, dtype, seed) -> torch.Tensor:
    blocks = random_blocks(shape, dtype, seed)
    blocks[0, 0, 0] = 0  # an all-zero group
    blocks[-1, -1, -1] = (torch.arange(blocks[0, 0, 0].numel()).view(blocks.shape[3:]) * 2**-24).to(dtype)
    return blocks.cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", CODEC_DTYPES)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("seed", [0, 1])
def test_cuda_codec_matches_reference_bit_for_bit(dtype, shape, seed):
    pytest.importorskip("cupy", reason="the CUDA kernels need CuPy")
    check_cuda_codec(cuda_blocks(shape, dtype, seed))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_cuda_codec_matches_reference_at_llama3_8b_size(dtype):
    """Real sizes: 32 blocks of Llama-3-8B (32 layers, block 16, 8 KV heads, head_dim 128), bit for bit."""
    pytest.importorskip("cupy", reason="the CUDA kernels need CuPy")
    check_cuda_codec(cuda_blocks((32, *llama3_8b().block_shape), dtype, seed=5))


def check_cuda_codec(blocks: torch.Tensor) -> None:
    """The CUDA quantizer and dequantizer (to every codec dtype) give the reference's bytes."""
    payload, scales = quantize_fp8(blocks)
    ref_payload, ref_scales = quantize_fp8_reference(blocks.cpu())
    assert torch.equal(payload.cpu(), ref_payload)
    assert torch.equal(scales.cpu().view(torch.uint8), ref_scales.view(torch.uint8))
    for out_dtype in CODEC_DTYPES:
        restored = dequantize_fp8(payload, scales, out_dtype)
        expected = dequantize_fp8_reference(ref_payload, ref_scales, out_dtype)
        assert torch.equal(restored.cpu().view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.gpu
def test_cuda_dequantize_from_unpacked_slot_views():
    """Strided views from unpack_fp8_slot work on CUDA exactly as on CPU."""
    pytest.importorskip("cupy", reason="the CUDA kernels need CuPy")
    layout = small_layout(dtype="bfloat16")
    slots = pack_fp8_slot(*quantize_fp8_reference(random_blocks((4, *layout.block_shape), seed=9)))
    expected = dequantize_fp8_reference(*unpack_fp8_slot(slots, layout), torch.bfloat16)
    restored = dequantize_fp8(*unpack_fp8_slot(slots.cuda(), layout), torch.bfloat16)
    assert torch.equal(restored.cpu().view(torch.uint8), expected.view(torch.uint8))
