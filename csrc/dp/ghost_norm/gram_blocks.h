// 4 x 4 blocks of float32 Gram products for the ghost norm kernel, in the
// widest SIMD this CPU runs (Note [Gram blocks]).
#pragma once

#include <cstdint>

namespace batchrules {

// out[4 i + l] = x_i . y_l for rows x_0..x_3 at x and y_0..y_3 at y, each n
// long and n apart.
using GramBlock = void (*)(const float* x, const float* y, int64_t n, float* out);

// The block kernel for this CPU (AVX-512, or AVX2 with FMA); nullptr on
// others, which keep the row kernel.
GramBlock gram_block_kernel();

}  // namespace batchrules
