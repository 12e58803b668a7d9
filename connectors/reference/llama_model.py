"""The reference Llama decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, with paged KV.

Its attention keeps no KV of its own: each layer writes the new tokens' K and V into the block
pool (`pool[:, layer, 0]` and `pool[:, layer, 1]`, docs/architecture.md §3) through the batch's block
tables and reads every sequence's context back from there (paged_attention.py). Whatever is in
the pool — computed in this pass, earlier, by another process, or restored from T1/T2 — is
what the model attends to. The math follows transformers' LlamaForCausalLM (the oracle in
tests/connectors/reference/test_llama_oracle.py): RMSNorm in fp32, rotate-half RoPE, SiLU-gated MLP.
Q, K and V come from one matmul (their weights concatenated at load), as do the MLP's gate and
up projections, and RoPE turns Q and K together: fewer, larger kernels per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtierd.connectors.reference.forward_batch import ForwardBatch
from kvtierd.connectors.reference.llama_config import LlamaConfig
from kvtierd.connectors.reference.llama_weights import check_weights
from kvtierd.connectors.reference.paged_attention import paged_attention
from kvtierd.connectors.reference.paged_kv_cache import write_kv
from kvtierd.errors import InvalidArgument


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalized in fp32, rounded to x's dtype, then scaled."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The halves of the last dim swapped: with a sine whose first half is negated, `x * cos +
    rotate_half(x) * signed_sin` is transformers' rotate-half RoPE, bit for bit (a sign flip is exact)."""
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)


QKV = "self_attn.qkv_proj.weight"  # [q_proj; k_proj; v_proj], built at load
GATE_UP = "mlp.gate_up_proj.weight"  # [gate_proj; up_proj]


class LlamaModel:
    """A Llama decoder over a paged KV pool. Stateless between calls: the pool is the state.

    `pool` is block-major `[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]`, of this
    model's dtype and device; `forward` writes only the slots its batch names.
    """

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        check_weights(config, weights)
        self.config = config
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # compare equal to the pool's cuda:N
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = dtype
        self.w = {name: tensor.to(self.device, dtype) for name, tensor in weights.items()}
        if config.tie_word_embeddings:
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]
        for layer in range(config.num_hidden_layers):
            p = f"model.layers.{layer}."
            self.w[p + QKV] = torch.cat([self.w.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
            self.w[p + GATE_UP] = torch.cat([self.w.pop(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")])
        exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
        self.inv_freq = (1.0 / (config.rope_theta ** exponents)).to(self.device)

    def check_pool(self, pool: torch.Tensor) -> None:
        c = self.config
        if pool.dim() != 6 or pool.shape[1:3] != (c.num_hidden_layers, 2) \
                or pool.shape[4:] != (c.num_key_value_heads, c.head_dim):
            raise InvalidArgument(f"a pool of shape {tuple(pool.shape)} does not hold this model's KV "
                                  f"({c.num_hidden_layers} layers, {c.num_key_value_heads} KV heads of {c.head_dim})")
        if pool.dtype != self.dtype or pool.device != self.device:
            raise InvalidArgument(f"the pool is {pool.dtype} on {pool.device}, the model {self.dtype} on {self.device}")

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and the signed sin (first half negated, see rotate_half) `[num_tokens, 1, head_dim]`,
        broadcast over heads."""
        freqs = positions.to(self.device).float().unsqueeze(1) * self.inv_freq.unsqueeze(0)
        cos, sin = freqs.cos().to(self.dtype), freqs.sin().to(self.dtype)
        return torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((-sin, sin), dim=-1).unsqueeze(1)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: torch.Tensor, *, all_logits: bool = False) -> torch.Tensor:
        """Logits `[num_seqs, vocab]` of each sequence's last token (`all_logits`: of every token)."""
        self.check_pool(pool)
        c, w = self.config, self.w
        num_tokens = batch.input_ids.shape[0]
        cos, sin = self.rope(batch.positions)
        x = F.embedding(batch.input_ids, w["model.embed_tokens.weight"])
        num_q, num_kv = c.num_attention_heads, c.num_key_value_heads
        for layer in range(c.num_hidden_layers):
            p = f"model.layers.{layer}."
            h = rms_norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)
            qkv = (h @ w[p + QKV].T).view(num_tokens, num_q + 2 * num_kv, c.head_dim)
            qk = qkv[:, :num_q + num_kv]
            qk = torch.addcmul(qk * cos, rotate_half(qk), sin)
            q, k, v = qk[:, :num_q], qk[:, num_q:], qkv[:, num_q + num_kv:]
            key_cache, value_cache = pool[:, layer, 0], pool[:, layer, 1]
            if not batch.writes_every_token:
                k, v = k[batch.write_token_index], v[batch.write_token_index]
            write_kv(key_cache, value_cache, k, v, batch.slot_block_ids, batch.slot_offsets)
            attended = paged_attention(q, key_cache, value_cache, batch.attention)
            x = x + attended.reshape(num_tokens, -1) @ w[p + "self_attn.o_proj.weight"].T
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            gate, up = (h @ w[p + GATE_UP].T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        if not all_logits:
            x = x[batch.last_token_index]
        x = rms_norm(x, w["model.norm.weight"], c.rms_norm_eps)
        return (x @ w["lm_head.weight"].T).float()
