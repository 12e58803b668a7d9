"""The model kinds the vLLM connector is proven on, as tiny models with real random weights, and the
engine settings each needs on the CPU.

    .venv-vllm/bin/python -m tests.connectors.vllm.model_kinds KIND DIRECTORY   # writes a checkpoint

Run with the vLLM venv's python: each model is its transformers class built from the kind's config
with a fixed torch seed, cast to bf16 and saved as safetensors by that venv's transformers, the
version vLLM reads; vLLM loads every tensor of it (not vLLM's dummy loader, which fills each tensor
uniformly in +-1e-3 whatever the config says, so that a wrong KV block barely moves a logprob).
Every kind has 2-4 layers, 4 query heads and a vocabulary of 1,000 (2.6-4.5 M parameters, 5-9 MB
on disk); `initializer_range` 0.1 (not 0.02) so that attention is not near-uniform and a wrong KV
block changes the output.
"""

from __future__ import annotations

import dataclasses
import sys


@dataclasses.dataclass(frozen=True)
class ModelKind:
    name: str
    description: str  # what it stands for, for test ids and the README's table
    config_class: str  # a transformers config class
    architecture: str
    fields: dict
    block_size: int | None = 32  # None: vLLM picks (a Mamba group makes it 160 here)
    tensor_parallel_size: int = 1

    def engine_kwargs(self) -> dict:
        """At TP 1 the engine runs in one process (the "uni" executor, the engine core in the caller:
        VLLM_ENABLE_V1_MULTIPROCESSING=0, see env), starting in ~15 s instead of ~40 s here; at TP 2
        each rank is a worker process, and the metadata crosses processes as in `vllm serve`."""
        kwargs = {"skip_tokenizer_init": True, "enforce_eager": True, "dtype": "bfloat16",
                  "max_model_len": 1024, "enable_prefix_caching": True,
                  "tensor_parallel_size": self.tensor_parallel_size}
        if self.tensor_parallel_size == 1:
            kwargs["distributed_executor_backend"] = "uni"
        if self.block_size is not None:
            kwargs["block_size"] = self.block_size
        return kwargs

    def env(self) -> dict[str, str]:
        """Settings vLLM on the CPU needs: TP 2 on 2 cores binds one OpenMP thread per rank."""
        if self.tensor_parallel_size == 1:
            return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        return {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


SEED = 0
COMMON = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64, max_position_embeddings=4096, initializer_range=0.1)
SLIDING_AND_FULL = ["sliding_attention", "full_attention"] * 2
LINEAR_AND_FULL = ["linear_attention", "full_attention"] * 2

KINDS = {kind.name: kind for kind in [
    ModelKind("gemma3", "Gemma-3-style: sliding window (64) + full attention", "Gemma3TextConfig",
              "Gemma3ForCausalLM", dict(COMMON, num_hidden_layers=4, sliding_window=64, layer_types=SLIDING_AND_FULL)),
    ModelKind("gptoss", "gpt-oss-style: MoE, sinks, sliding window (64) + full attention", "GptOssConfig",
              "GptOssForCausalLM", dict(COMMON, num_hidden_layers=4, sliding_window=64, num_local_experts=4,
                                        num_experts_per_tok=2, intermediate_size=256, layer_types=SLIDING_AND_FULL)),
    ModelKind("qwen3next", "Qwen3-Next-style: linear attention (GDN) + full attention", "Qwen3NextConfig",
              "Qwen3NextForCausalLM", dict(COMMON, num_hidden_layers=4, linear_num_value_heads=4,
                                           linear_num_key_heads=2, linear_key_head_dim=64, linear_value_head_dim=64,
                                           linear_conv_kernel_dim=4, layer_types=LINEAR_AND_FULL, num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=128,
                                           shared_expert_intermediate_size=128, decoder_sparse_step=1),
              block_size=None),
    ModelKind("deepseekv2", "DeepSeek-V2-style: MLA (576-wide latent) + MoE", "DeepseekV2Config",
              "DeepseekV2ForCausalLM", dict(COMMON, num_hidden_layers=2, num_key_value_heads=4, kv_lora_rank=512,
                                            q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=64, qk_nope_head_dim=64,
                                            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                                            first_k_dense_replace=1, n_shared_experts=1, n_group=2, topk_group=1)),
    ModelKind("deepseekv2-tp2", "DeepSeek-V2-style MLA at tensor parallel 2 (the latent replicated)",
              "DeepseekV2Config", "DeepseekV2ForCausalLM", {}, tensor_parallel_size=2),
    ModelKind("llama-tp2", "Llama at tensor parallel 2 (one KV head a rank)", "LlamaConfig", "LlamaForCausalLM",
              dict(COMMON, num_hidden_layers=4), tensor_parallel_size=2),
]}
KINDS["deepseekv2-tp2"] = dataclasses.replace(KINDS["deepseekv2-tp2"], fields=KINDS["deepseekv2"].fields)


def write_model(kind: ModelKind, directory: str) -> None:
    """DIRECTORY/config.json and model.safetensors: the kind's transformers model, initialized by
    transformers from torch seed SEED, in bf16."""
    import torch
    import transformers

    config = getattr(transformers, kind.config_class)(**kind.fields)
    config.architectures = [kind.architecture]
    torch.manual_seed(SEED)
    model = getattr(transformers, kind.architecture)(config).to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(directory, safe_serialization=True)


if __name__ == "__main__":
    write_model(KINDS[sys.argv[1]], sys.argv[2])
