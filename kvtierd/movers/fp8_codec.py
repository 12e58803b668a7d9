"""fp8 (e4m3) storage of KV blocks: half the bytes of fp16 in the host and SSD tiers.

Blocks are block-major, `[n, num_layers, 2, block_size, num_kv_heads, head_dim]` in fp16, bf16
or fp32. A "group" is the K (or V) of one block in one layer; each group has one float32 scale:
    amax  = max |x| over the group
    scale = amax / 448 if amax > 0 else 1.0     (448 = largest finite e4m3 value)
    q     = e4m3(x / scale)                     round to nearest even, saturating at ±448
    y     = dtype(float(q) * scale)             round to nearest even
Each step is one correctly rounded IEEE fp32 operation (a true division, not a reciprocal
multiply), so the CUDA kernels (kernels/fp8_codec.cu) and the torch references below produce
identical bytes for finite inputs. Zeros stay zeros and the element of largest magnitude comes
back as ±448·scale. Error bound per element (derivation in tests/movers/test_fp8_codec.py):
    |x - y| <= |x|·(1/17 + 2u + 2**-22) + scale·2**-9 + η
with u the unit roundoff of the output dtype (fp16 2**-11, bf16 2**-8, fp32 2**-24) and η half
its smallest subnormal plus 2**-149 (fp32 underflow; fp16: η ≈ 2**-25).

One slot per block for a tier (`pack_fp8_slot`): the payload (1 byte per element, block-major),
zero padding to a multiple of 4 bytes, then the scales `[num_layers, 2]` as native-endian
float32 (little-endian on every platform kvtierd runs on).
"""

from __future__ import annotations

import math
from collections.abc import Collection

import numpy as np
import torch

from kvtierd.errors import InvalidArgument
from kvtierd.layout import Layout
from kvtierd.movers.cuda_kernels import launch_kernel, load_kernel, uses_cuda_kernel
from kvtierd.units import round_up

FP8_E4M3_MAX = 448.0
KERNEL_SOURCE = "fp8_codec.cu"
QUANTIZE_KERNELS = {torch.float16: "fp8_quantize_f16", torch.bfloat16: "fp8_quantize_bf16",
                    torch.float32: "fp8_quantize_f32"}
DEQUANTIZE_KERNELS = {torch.float16: "fp8_dequantize_f16", torch.bfloat16: "fp8_dequantize_bf16",
                      torch.float32: "fp8_dequantize_f32"}
# Every kernel name this module launches, by source file; tests check them in the compiled code.
KERNEL_NAMES: dict[str, tuple[str, ...]] = {
    KERNEL_SOURCE: (*QUANTIZE_KERNELS.values(), *DEQUANTIZE_KERNELS.values())}

THREADS_PER_BLOCK = 256  # a multiple of 32: the quantize kernel reduces per warp
_MAX_GRID = 1 << 20  # the kernels grid-stride past this
_SCALE_BYTES = 4  # float32


def _check_blocks(blocks: torch.Tensor, name: str, dtypes: Collection[torch.dtype]) -> None:
    if (not isinstance(blocks, torch.Tensor) or blocks.dim() != 6 or blocks.shape[2] != 2
            or min(blocks.shape[1:]) == 0):
        raise InvalidArgument(
            f"{name} must be a [n, num_layers, 2, block_size, heads, dim] tensor, got "
            f"{tuple(blocks.shape) if isinstance(blocks, torch.Tensor) else type(blocks).__name__}")
    if blocks.dtype not in dtypes:
        raise InvalidArgument(f"{name} dtype must be one of {list(dtypes)}, got {blocks.dtype}")


def _check_scales(payload: torch.Tensor, scales: torch.Tensor) -> None:
    _check_blocks(payload, "payload", (torch.uint8,))
    if (not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32
            or tuple(scales.shape) != tuple(payload.shape[:3])):
        raise InvalidArgument(f"scales must be float32 {tuple(payload.shape[:3])}")
    if scales.device != payload.device:
        raise InvalidArgument(f"scales are on {scales.device}, the payload on {payload.device}")


def _check_out_dtype(dtype: torch.dtype) -> None:
    if dtype not in DEQUANTIZE_KERNELS:
        raise InvalidArgument(f"dtype must be one of {list(DEQUANTIZE_KERNELS)}, got {dtype}")


def quantize_fp8(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload uint8 of blocks' shape holding e4m3 codes, scales float32 [n, num_layers, 2]).

    On CUDA with CuPy: the kernel, asynchronous on torch's current stream; else the reference.
    """
    _check_blocks(blocks, "blocks", QUANTIZE_KERNELS)
    if not uses_cuda_kernel(blocks):
        return quantize_fp8_reference(blocks)
    blocks = blocks.contiguous()
    payload = torch.empty(blocks.shape, dtype=torch.uint8, device=blocks.device)
    scales = torch.empty(blocks.shape[:3], dtype=torch.float32, device=blocks.device)
    num_groups = scales.numel()
    if num_groups:
        group_numel = blocks[0, 0, 0].numel()
        args = (np.uint64(blocks.data_ptr()), np.uint64(payload.data_ptr()),
                np.uint64(scales.data_ptr()), np.int64(num_groups), np.int64(group_numel))
        launch_kernel(load_kernel(KERNEL_SOURCE, QUANTIZE_KERNELS[blocks.dtype]), blocks.device,
                      (min(num_groups, _MAX_GRID),), (THREADS_PER_BLOCK,), args)
    return payload, scales


def dequantize_fp8(payload: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks of `dtype` (fp16, bf16 or fp32) from `quantize_fp8`'s payload and scales."""
    _check_scales(payload, scales)
    _check_out_dtype(dtype)
    if not uses_cuda_kernel(payload):
        return dequantize_fp8_reference(payload, scales, dtype)
    payload, scales = payload.contiguous(), scales.contiguous()
    out = torch.empty(payload.shape, dtype=dtype, device=payload.device)
    num_elements = payload.numel()
    if num_elements:
        group_numel = payload[0, 0, 0].numel()
        args = (np.uint64(payload.data_ptr()), np.uint64(scales.data_ptr()),
                np.uint64(out.data_ptr()), np.int64(num_elements), np.int64(group_numel))
        grid = (min(math.ceil(num_elements / THREADS_PER_BLOCK), _MAX_GRID),)
        launch_kernel(load_kernel(KERNEL_SOURCE, DEQUANTIZE_KERNELS[dtype]), payload.device,
                      grid, (THREADS_PER_BLOCK,), args)
    return out


def quantize_fp8_reference(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8` in plain torch (any device), step for step as the kernel computes it."""
    _check_blocks(blocks, "blocks", QUANTIZE_KERNELS)
    num_blocks, num_layers = blocks.shape[:2]
    group_numel = math.prod(blocks.shape[3:])
    groups = blocks.reshape(num_blocks, num_layers, 2, group_numel).float()  # exact
    amax = groups.abs().amax(dim=-1)
    # Divide by a tensor, not a Python scalar: torch's CUDA division by a scalar multiplies
    # by its reciprocal, which can differ in the last bit.
    divisor = torch.full_like(amax, FP8_E4M3_MAX)
    scales = torch.where(amax > 0, amax / divisor, torch.ones_like(amax))
    # The clamp makes the cast saturating (satfinite), whatever torch does out of range.
    codes = (groups / scales[..., None]).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    payload = codes.to(torch.float8_e4m3fn).view(torch.uint8).reshape(blocks.shape)
    return payload, scales


def dequantize_fp8_reference(payload: torch.Tensor, scales: torch.Tensor,
                             dtype: torch.dtype) -> torch.Tensor:
    """`dequantize_fp8` in plain torch (any device): y = dtype(float32(q) * scale)."""
    _check_scales(payload, scales)
    _check_out_dtype(dtype)
    num_blocks, num_layers = payload.shape[:2]
    group_numel = math.prod(payload.shape[3:])
    values = payload.contiguous().view(torch.float8_e4m3fn).float()  # exact
    values = values.reshape(num_blocks, num_layers, 2, group_numel) * scales[..., None]
    return values.to(dtype).reshape(payload.shape)


def _slot_geometry(block_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(payload bytes, scales offset, slot bytes) of one block of `block_shape` [L, 2, B, H, D]."""
    payload_nbytes = math.prod(block_shape)
    scales_offset = round_up(payload_nbytes, _SCALE_BYTES)
    return payload_nbytes, scales_offset, scales_offset + _SCALE_BYTES * 2 * block_shape[0]


def fp8_slot_nbytes(layout: Layout) -> int:
    """Bytes of one fp8 slot: 1 byte per element (half of fp16), padding to 4, 8 per layer."""
    return _slot_geometry(layout.block_shape)[2]


def pack_fp8_slot(payload: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One contiguous uint8 slot per block, `[n, slot_nbytes]`: payload | padding | scales."""
    _check_scales(payload, scales)
    num_blocks = payload.shape[0]
    payload_nbytes, scales_offset, slot_nbytes = _slot_geometry(tuple(payload.shape[1:]))
    slots = torch.zeros((num_blocks, slot_nbytes), dtype=torch.uint8, device=payload.device)
    slots[:, :payload_nbytes] = payload.reshape(num_blocks, payload_nbytes)
    slots[:, scales_offset:] = scales.contiguous().view(torch.uint8).reshape(
        num_blocks, slot_nbytes - scales_offset)
    return slots


def unpack_fp8_slot(slots: torch.Tensor, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload [n, *layout.block_shape] uint8, scales [n, L, 2] float32): views into `slots`."""
    payload_nbytes, scales_offset, slot_nbytes = _slot_geometry(layout.block_shape)
    if (not isinstance(slots, torch.Tensor) or slots.dtype != torch.uint8 or slots.dim() != 2
            or slots.shape[1] != slot_nbytes):
        raise InvalidArgument(f"slots must be uint8 [n, {slot_nbytes}] for this layout")
    if not slots.is_contiguous() or slots.storage_offset() % _SCALE_BYTES:
        slots = slots.clone()  # the float32 view of the scales needs 4-byte alignment
    num_blocks = slots.shape[0]
    payload = slots[:, :payload_nbytes].view(num_blocks, *layout.block_shape)
    scales = slots[:, scales_offset:].view(torch.float32).view(num_blocks, layout.num_layers, 2)
    return payload, scales
