// copy_blocks of the kvpage CuPy backend: for each (src, dst) pair,
// base[w, dst, :] = base[w, src, :] for w in {0, 1} (K and V, or the K and V int8
// scales), copied as raw words W (unsigned int when the block's byte size allows,
// unsigned char otherwise), so the copy is bit-exact.
// Grid (num_pairs, 2), any block size; the launcher guarantees distinct destinations that
// are never sources, so blocks run in any order.
namespace kvpage {

template <typename W>
__global__ void copy_blocks(W* __restrict__ base, long long which_stride,
                            long long block_stride, long long words_per_block,
                            const long long* __restrict__ pairs) {
  const long long src = pairs[2 * blockIdx.x];
  const long long dst = pairs[2 * blockIdx.x + 1];
  W* plane = base + blockIdx.y * which_stride;
  for (long long e = threadIdx.x; e < words_per_block; e += blockDim.x) {
    plane[dst * block_stride + e] = plane[src * block_stride + e];
  }
}

}  // namespace kvpage
