"""The reference runner: batched prefill and decode of a LlamaModel over a KvBackend's pool.

`generate` admits every request (the backend hands out block tables, with the cached prefix
already in the pool), prefills all of them in one varlen pass — only the tokens past each
cached prefix — then decodes them together, one token per sequence per pass, until each has
its `max_new_tokens` (or its stop token). Blocks are committed as they fill and released at
the end. n > 1 forks a request after its prefill; the n samples then share the prompt's
blocks and copy the partial one on their first write (copy-on-write).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from kvtierd.block_hash import PromptExtras
from kvtierd.connectors.reference.forward_batch import ForwardBatch, SequenceChunk
from kvtierd.connectors.reference.kv_backend import KvBackend
from kvtierd.connectors.reference.llama_model import LlamaModel
from kvtierd.errors import InvalidArgument


@dataclasses.dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int = 16
    n: int = 1  # samples; n > 1 forks after the prefill
    temperature: float = 0.0  # 0: greedy
    seed: int = 0  # sample i draws from torch.Generator seeded seed + i
    cache_salt: str | None = None
    lora_id: str | None = None
    stop_token_id: int | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise InvalidArgument(f"request {self.request_id!r} has an empty prompt")
        if self.max_new_tokens < 1 or self.n < 1 or self.temperature < 0:
            raise InvalidArgument(f"request {self.request_id!r} needs max_new_tokens >= 1, n >= 1, temperature >= 0")

    @property
    def extras(self) -> PromptExtras:
        return PromptExtras(lora_id=self.lora_id, cache_salt=self.cache_salt)


@dataclasses.dataclass(slots=True)
class GenerationResult:
    request_id: str
    output_token_ids: list[list[int]]  # one list per sample
    ttft_s: float  # admission to the first token, prefill included
    num_prompt_tokens: int
    num_computed_prompt_tokens: int  # prompt tokens whose KV this run computed
    num_t0_hit_tokens: int
    num_t1_hit_tokens: int
    num_t2_hit_tokens: int
    step_logits: list[list[torch.Tensor]] | None = None  # per sample, the logits of each token, if recorded
    num_t3_hit_tokens: int = 0  # loaded from the shared store

    @property
    def num_hit_tokens(self) -> int:
        return self.num_t0_hit_tokens + self.num_t1_hit_tokens + self.num_t2_hit_tokens + self.num_t3_hit_tokens


@dataclasses.dataclass(slots=True)
class _Sequence:
    """One sample being generated. `token_ids` = prompt + output; KV is in the pool for the first
    `num_tokens_with_kv` of them; `shared_block_index` is the block it shares after a fork."""

    request_id: str
    request: GenerationRequest
    token_ids: list[int]
    block_ids: list[int]
    num_tokens_with_kv: int
    generator: torch.Generator | None
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    logits: list[torch.Tensor] = dataclasses.field(default_factory=list)
    shared_block_index: int | None = None

    @property
    def done(self) -> bool:
        r = self.request
        return len(self.output_token_ids) >= r.max_new_tokens or (
            r.stop_token_id is not None and self.output_token_ids[-1:] == [r.stop_token_id])


class ReferenceRunner:
    def __init__(self, model: LlamaModel, backend: KvBackend, *, record_logits: bool = False) -> None:
        self.model = model
        self.backend = backend
        self.block_size = backend.block_size
        self.record_logits = record_logits
        model.check_pool(backend.pool)

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        if len({r.request_id for r in requests}) != len(requests):
            raise InvalidArgument("request ids in one generate call must be distinct")
        started_s = time.perf_counter()
        results, sequences, admitted = [], [], []
        try:
            chunks = []
            for request in requests:
                started = self.backend.start(request.request_id, request.prompt_token_ids, request.extras)
                admitted.append(request.request_id)
                prompt = request.prompt_token_ids
                first = min(started.num_cached_tokens, len(prompt) - 1)
                chunks.append(SequenceChunk(prompt[first:], first, started.block_ids, started.num_cached_tokens))
                results.append(GenerationResult(
                    request.request_id, [], 0.0, len(prompt), len(prompt) - started.num_cached_tokens,
                    started.num_t0_hit_tokens, started.num_t1_hit_tokens, started.num_t2_hit_tokens,
                    num_t3_hit_tokens=started.num_t3_hit_tokens))
            prefill_started_s = time.perf_counter()
            logits = self.model.forward(ForwardBatch.build(chunks, self.block_size, self.model.device),
                                        self.backend.pool)
            self._observe_prefill(chunks, logits, prefill_started_s)
            for request, chunk, row, result in zip(requests, chunks, logits, results):
                family = self._after_prefill(request, chunk, row, result, started_s)
                admitted.extend(s.request_id for s in family[1:])
                sequences.append(family)
            self._decode([s for family in sequences for s in family if not s.done])
        finally:
            for request_id in admitted:
                self.backend.finish(request_id)
        for result, family in zip(results, sequences):
            result.output_token_ids = [s.output_token_ids for s in family]
            if self.record_logits:
                result.step_logits = [s.logits for s in family]
        return results

    def _after_prefill(self, request: GenerationRequest, chunk: SequenceChunk, logits: torch.Tensor,
                       result: GenerationResult, started_s: float) -> list[_Sequence]:
        """Sample the first token (the TTFT ends here), commit the prompt's full blocks, then fork
        the n - 1 siblings, each sampling its own first token from the same logits."""
        prompt = request.prompt_token_ids
        first = _Sequence(request.request_id, request, list(prompt), list(chunk.block_table), len(prompt),
                          self._generator(request, 0))
        self._append_token(first, logits)
        result.ttft_s = time.perf_counter() - started_s
        self.backend.blocks_filled(request.request_id, prompt, len(prompt))
        family = [first]
        for i in range(1, request.n):
            child_id = f"{request.request_id}#{i}"
            block_ids = self.backend.fork(request.request_id, child_id)
            child = _Sequence(child_id, request, list(prompt), block_ids, len(prompt), self._generator(request, i))
            self._append_token(child, logits)
            family.append(child)
        if request.n > 1:  # every sibling shares the block the next token is written into
            for sequence in family:
                sequence.shared_block_index = len(prompt) // self.block_size
        return family

    def _observe_prefill(self, chunks: list[SequenceChunk], logits: torch.Tensor, started_s: float) -> None:
        """Tell the backend what this prefill cost: the tokens it computed over its seconds, once
        the device has finished it."""
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        self.backend.observe_prefill(sum(len(chunk.token_ids) for chunk in chunks), time.perf_counter() - started_s)

    def _decode(self, active: list[_Sequence]) -> None:
        while active:
            chunks = [self._decode_chunk(s) for s in active]
            logits = self.model.forward(ForwardBatch.build(chunks, self.block_size, self.model.device),
                                        self.backend.pool)
            for sequence, row in zip(active, logits):
                sequence.num_tokens_with_kv += 1
                self.backend.blocks_filled(sequence.request_id, sequence.token_ids, sequence.num_tokens_with_kv)
                self._append_token(sequence, row)
            active = [s for s in active if not s.done]

    def _decode_chunk(self, sequence: _Sequence) -> SequenceChunk:
        """The last sampled token at its position, with a block to write it into."""
        position = sequence.num_tokens_with_kv
        block_index = position // self.block_size
        if block_index == len(sequence.block_ids):
            sequence.block_ids.extend(self.backend.grow(sequence.request_id, 1))
        if block_index == sequence.shared_block_index:
            sequence.block_ids[block_index] = self.backend.write_target(sequence.request_id, position)
            sequence.shared_block_index = None
        return SequenceChunk([sequence.token_ids[-1]], position, sequence.block_ids, position)

    def _append_token(self, sequence: _Sequence, logits: torch.Tensor) -> None:
        if self.record_logits:
            sequence.logits.append(logits.detach().clone())
        if sequence.generator is None:
            token = int(logits.argmax())
        else:
            probs = torch.softmax(logits.float().cpu() / sequence.request.temperature, dim=-1)  # CPU generator
            token = int(torch.multinomial(probs, 1, generator=sequence.generator))
        sequence.token_ids.append(token)
        sequence.output_token_ids.append(token)

    @staticmethod
    def _generator(request: GenerationRequest, sample: int) -> torch.Generator | None:
        if request.temperature == 0:
            return None
        return torch.Generator().manual_seed(request.seed + sample)
