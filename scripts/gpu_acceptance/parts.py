"""The parts of the GPU acceptance run: what each runs, what it proves, and its time cap.

A part is one subprocess: either the `gpu`-marked tests of some test files (pytest, with
KVTIERD_REQUIRE_GPU=1 so that a skip is a failure) or one benchmark script. Every gpu test file
belongs to exactly one part (the dry run checks it). `checks` names the tests that prove a CUDA
path's claim on their own; the report gives each its own row.
"""

from __future__ import annotations

import dataclasses

PER_TEST_TIMEOUT_S = 120  # pytest-timeout (carried): one hung test fails alone, the part goes on


@dataclasses.dataclass(frozen=True)
class Check:
    what: str
    node_id: str  # a test node id; a parametrized test counts as passed when all its cases pass


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    what: str
    timeout_s: int
    test_files: tuple[str, ...] = ()
    checks: tuple[Check, ...] = ()
    benchmark: tuple[str, ...] = ()  # the script and its arguments

    @property
    def is_tests(self) -> bool:
        return bool(self.test_files)

    def argv(self, junit_path: str) -> list[str]:
        """The command after the interpreter."""
        if self.is_tests:
            return ["-m", "pytest", "-m", "gpu", "-q", "-rfEs", "-p", "no:cacheprovider",
                    "--timeout", str(PER_TEST_TIMEOUT_S), "--junitxml", junit_path, *self.test_files]
        return list(self.benchmark)


PARTS = (
    Part("tests-kernels", "kv_layout (engine pages in one gather) and fp8_codec kernels against their torch "
         "references, the reference runner's SDPA / Triton paged attention, small shapes and Llama-3-8B sizes", 180,
         ("tests/movers/test_layout_kernels.py", "tests/movers/test_fp8_codec.py",
          "tests/connectors/reference/test_paged_attention.py"),
         (Check("kv_layout gather/scatter bit for bit, Llama-3-8B size",
                "tests/movers/test_layout_kernels.py::test_cuda_gather_and_scatter_match_reference_at_llama3_8b_size"),
          Check("fp8 codec bit for bit, Llama-3-8B size",
                "tests/movers/test_fp8_codec.py::test_cuda_codec_matches_reference_at_llama3_8b_size"),
          Check("paged attention within the fp32-accumulation tolerances, Llama-3-8B size",
                "tests/connectors/reference/test_paged_attention.py::test_cuda_matches_reference_at_llama3_8b_size"))),
    Part("tests-pool", "the CUDA device pool, its IPC handle and its cuMem POSIX fd, the copy engine's streams, "
         "batched copies, the host slab pinned in grains", 120,
         ("tests/t0/test_cuda_pool.py", "tests/t0/test_pool_by_fd.py", "tests/movers/test_copy_engine.py",
          "tests/movers/test_span_copy.py", "tests/t1/test_host_pinning.py"),
         (Check("two processes share a CUDA pool through its IPC handle",
                "tests/t0/test_cuda_pool.py::test_second_process_maps_the_pool_through_the_ipc_handle"),
          Check("a shuffled T0 <-> T1 job is one cuMemcpyBatchAsync, bit exact",
                "tests/movers/test_span_copy.py::test_on_cuda_a_shuffled_job_is_one_batched_driver_call_and_bit_exact"),
          Check("the host slab pinned in three grains, copies across them exact",
                "tests/t1/test_host_pinning.py::test_on_cuda_the_slab_is_pinned_in_grains_and_copies_across_them_are_exact"))),
    Part("tests-daemon", "a daemon with a CUDA pool serving the reference runner and the vLLM connector's "
         "CUDA engine caches", 150,
         ("tests/connectors/reference/test_reference_runner.py", "tests/connectors/vllm/test_vllm_connector.py",
          "tests/connectors/vllm/test_vllm_engine_pages.py", "tests/connectors/vllm/test_vllm_load_decision.py"),
         (Check("daemon with a CUDA pool: runner restores from T1, generation identical to recompute",
                "tests/connectors/reference/test_reference_runner.py::test_on_cuda_a_prefix_restored_from_t1_matches_the_cpu_recompute"),)),
    Part("bench-copy", "T0 <-> T1 sweep: 64 KiB / 256 KiB / 2 MiB blocks x contiguous / shuffled ids x d2h / h2d / "
         "both, 256 MiB a job, vs cudaMemcpyAsync of the span", 90,
         benchmark=("benchmarks/bench_tier_copy.py",)),
    Part("bench-engine-pages", "the vLLM connector's engine pages <-> pool, 256 blocks x 32 layers x 64 KiB, "
         "fragmented vs contiguous ids vs one device copy", 60,
         benchmark=("benchmarks/bench_engine_pages.py", "--cuda")),
    Part("bench-attention", "the reference runner's paged attention (SDPA, Triton decode) vs torch SDPA on the same "
         "KV, bf16", 90,
         benchmark=("benchmarks/bench_paged_attention.py",)),
    Part("bench-ttft", "TTFT of a 1.1 B Llama in bf16, 4k-token prefix from T0 / T1 / T2 vs the fastest recompute "
         "(transformers' SDPA or our runner)", 200,
         benchmark=("benchmarks/bench_ttft.py", "--cuda")),
    Part("bench-pinning", "64 GiB host slab pinned grain by grain (parallel first touch on the GPU's NUMA node, "
         "cudaHostRegister) vs cudaHostAlloc, s/GiB", 150,
         benchmark=("benchmarks/bench_host_pinning.py",)),
)
PART_NAMES = tuple(part.name for part in PARTS)


def select(only: str | None) -> list[Part]:
    """The parts named in `only` ("tests-pool,bench-copy"), in run order; all of them for None."""
    if not only:
        return list(PARTS)
    names = [name.strip() for name in only.split(",") if name.strip()]
    unknown = sorted(set(names) - set(PART_NAMES))
    if unknown:
        raise ValueError(f"unknown part(s) {', '.join(unknown)}; the parts are {', '.join(PART_NAMES)}")
    return [part for part in PARTS if part.name in names]
