"""Recompute baselines for TTFT: transformers' LlamaForCausalLM (SDPA attention) with the very
weights of the reference runner's model, and the check that a first token agrees with another's.

transformers is the dev extra's (and the GPU machine's); the benchmark needs it: a missing
baseline is an error, not a skipped row.
"""

from __future__ import annotations

import time

import torch

from kvtierd.connectors.reference.llama_config import LlamaConfig

# In bf16/fp16 two correct implementations round differently: a first token agrees with a
# reference's when the reference scores it within this fraction of its largest |logit| of its best.
LOW_PRECISION_LOGIT_MARGIN = 0.05


class TransformersRecompute:
    """`LlamaForCausalLM(config)` with `attn_implementation="sdpa"` in `dtype` on `device`, holding
    `weights` (transformers' parameter names, as the reference runner's). A prefill computes the
    last position's logits only (`logits_to_keep=1`) and keeps no cache: the fastest first token
    transformers gives."""

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], device: torch.device | str,
                 dtype: torch.dtype) -> None:
        try:
            import transformers
        except ImportError as e:
            raise SystemExit(f"the transformers baseline needs transformers (the dev extra): {e}") from e
        self.device = torch.device(device)
        with self.device:  # parameters and buffers (RoPE's fp32 inv_freq) made there, in dtype
            model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**config.to_hf()),
                                                                  dtype=dtype, attn_implementation="sdpa")
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise AssertionError(f"weights do not fit LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
        self.model = model.eval()
        self.version = transformers.__version__

    def first_token(self, token_ids: list[int]) -> tuple[int, float, torch.Tensor]:
        """The greedy first token after `token_ids`, the seconds to it (ids to the device, prefill,
        argmax read back), and the last position's logits (fp32)."""
        started_s = time.perf_counter()
        with torch.inference_mode():
            ids = torch.tensor([token_ids], device=self.device)
            logits = self.model(input_ids=ids, logits_to_keep=1, use_cache=False).logits[0, -1]
            token = int(logits.argmax())
        return token, time.perf_counter() - started_s, logits.float()


def agrees(token: int, reference_logits: torch.Tensor, exact: bool) -> bool:
    """`token` is the reference's greedy choice (`exact`, fp32), or one it scores within
    LOW_PRECISION_LOGIT_MARGIN of its best (bf16/fp16)."""
    best = reference_logits.max()
    if exact:
        return token == int(reference_logits.argmax())
    margin = LOW_PRECISION_LOGIT_MARGIN * float(reference_logits.abs().max())
    return float(reference_logits[token]) >= float(best) - margin
