// Gather/scatter between an engine's per-layer KV caches and kvtierd's block-major slots.
//
// Engine side (vLLM style): one contiguous tensor per layer,
//   cache[layer] = [2, num_engine_blocks, block_size, num_kv_heads, head_dim].
// kvtierd side: one contiguous slot per block,
//   slots = [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim].
// In both, the K (or V) of one block in one layer is one contiguous span of
// chunk_bytes = block_size * num_kv_heads * head_dim * dtype_bytes bytes: a "chunk".
//   engine chunk (layer, kv, engine block b): cache[layer] + (kv * num_engine_blocks + b) * chunk_bytes
//   slot chunk   (slot i, layer, kv):         slots + ((i * num_layers + layer) * 2 + kv) * chunk_bytes
//
// kv_copy_cells moves pages between an engine allocation and a pool whatever the layout: both are
// seen as arrays of cells of cell_bytes bytes, and cell dst_cells[i] of dst gets cell src_cells[i]
// of src (a null index array means cell i of that side), so a load or store of any ids is one launch.
//
// The kernels copy raw bytes, never values, so they are bit exact for every dtype.
// Each chunk is copied in units of unit_bytes (16, 8, 4, 2 or 1); the caller picks the
// largest unit that divides chunk_bytes and the address of every base pointer.
// Launch: grid.x walks chunks (grid-stride), grid.y splits one chunk across CUDA blocks,
// any blockDim.x. Block ids are validated by the caller; scatter ids must be unique.
// No CUDA headers: loadable with cupy.RawModule (NVRTC) and compiled by nvcc in tests.

typedef unsigned long long u64;

template <typename Unit>
__device__ __forceinline__ void copy_units(unsigned char* __restrict__ dst,
                                           const unsigned char* __restrict__ src,
                                           long long chunk_bytes) {
  const Unit* s = reinterpret_cast<const Unit*>(src);
  Unit* d = reinterpret_cast<Unit*>(dst);
  const long long num_units = chunk_bytes / (long long)sizeof(Unit);
  const long long stride = (long long)gridDim.y * blockDim.x;
  for (long long i = (long long)blockIdx.y * blockDim.x + threadIdx.x; i < num_units; i += stride) {
    d[i] = s[i];
  }
}

__device__ __forceinline__ void copy_chunk(unsigned char* dst, const unsigned char* src,
                                           long long chunk_bytes, int unit_bytes) {
  switch (unit_bytes) {
    case 16: copy_units<uint4>(dst, src, chunk_bytes); break;
    case 8: copy_units<uint2>(dst, src, chunk_bytes); break;
    case 4: copy_units<unsigned int>(dst, src, chunk_bytes); break;
    case 2: copy_units<unsigned short>(dst, src, chunk_bytes); break;
    default: copy_units<unsigned char>(dst, src, chunk_bytes); break;
  }
}

// The engine chunk that slot chunk `chunk` (slot i, layer, kv) maps to: cache[layer][kv, block_ids[i]].
__device__ __forceinline__ unsigned char* engine_chunk(const u64* __restrict__ layer_ptrs,
                                                       const long long* __restrict__ block_ids,
                                                       long long chunk, int num_layers,
                                                       long long num_engine_blocks, long long chunk_bytes) {
  const long long kv = chunk % 2;
  const int layer = (int)((chunk / 2) % num_layers);
  const long long slot = chunk / 2 / num_layers;
  unsigned char* cache = reinterpret_cast<unsigned char*>(layer_ptrs[layer]);
  return cache + (kv * num_engine_blocks + block_ids[slot]) * chunk_bytes;
}

// slots[i, layer, kv] = cache[layer][kv, block_ids[i]] for every i < num_blocks.
extern "C" __global__ void kv_gather_blocks(const u64* __restrict__ layer_ptrs,
                                            const long long* __restrict__ block_ids,
                                            unsigned char* __restrict__ slots,
                                            int num_blocks, int num_layers,
                                            long long num_engine_blocks, long long chunk_bytes,
                                            int unit_bytes) {
  const long long num_chunks = (long long)num_blocks * num_layers * 2;
  for (long long chunk = blockIdx.x; chunk < num_chunks; chunk += gridDim.x) {
    copy_chunk(slots + chunk * chunk_bytes,
               engine_chunk(layer_ptrs, block_ids, chunk, num_layers, num_engine_blocks, chunk_bytes),
               chunk_bytes, unit_bytes);
  }
}

// cache[layer][kv, block_ids[i]] = slots[i, layer, kv] for every i < num_blocks.
extern "C" __global__ void kv_scatter_blocks(const u64* __restrict__ layer_ptrs,
                                             const long long* __restrict__ block_ids,
                                             const unsigned char* __restrict__ slots,
                                             int num_blocks, int num_layers,
                                             long long num_engine_blocks, long long chunk_bytes,
                                             int unit_bytes) {
  const long long num_chunks = (long long)num_blocks * num_layers * 2;
  for (long long chunk = blockIdx.x; chunk < num_chunks; chunk += gridDim.x) {
    copy_chunk(engine_chunk(layer_ptrs, block_ids, chunk, num_layers, num_engine_blocks, chunk_bytes),
               slots + chunk * chunk_bytes, chunk_bytes, unit_bytes);
  }
}

// dst cell dst_cells[i] = src cell src_cells[i] for every i < num_cells; a null index array is the
// identity (cell i). Cells are validated by the caller; a cell named twice as a destination gets
// one of its sources' bytes. Launch as the kernels above, grid.x walking cells.
extern "C" __global__ void kv_copy_cells(unsigned char* __restrict__ dst,
                                         const long long* __restrict__ dst_cells,
                                         const unsigned char* __restrict__ src,
                                         const long long* __restrict__ src_cells,
                                         long long num_cells, long long cell_bytes, int unit_bytes) {
  for (long long cell = blockIdx.x; cell < num_cells; cell += gridDim.x) {
    const long long dst_cell = dst_cells != nullptr ? dst_cells[cell] : cell;
    const long long src_cell = src_cells != nullptr ? src_cells[cell] : cell;
    copy_chunk(dst + dst_cell * cell_bytes, src + src_cell * cell_bytes, cell_bytes, unit_bytes);
  }
}
