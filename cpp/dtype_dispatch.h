// Runtime Dtype -> C++ element type, shared by the CPU and CUDA kernels. Each platform names its
// element types in a struct (float32, bfloat16, float16 and the two float8 formats) and calls
// visit_input<Types>(dtype, f) or visit_output<Types>(dtype, f), which call f(Tag<T>{}).
#pragma once

#include "kernel_args.h"

namespace moe {

template <typename T> struct Tag { using type = T; };

// Types: a struct with the aliases f32, bf16, f16, f8e4m3fn and f8e5m2.
template <typename Types, typename F>
void visit_input(Dtype d, F&& f) {
  switch (d) {
    case Dtype::kF32: return f(Tag<typename Types::f32>{});
    case Dtype::kBF16: return f(Tag<typename Types::bf16>{});
    case Dtype::kF16: return f(Tag<typename Types::f16>{});
    case Dtype::kF8E4M3FN: return f(Tag<typename Types::f8e4m3fn>{});
    case Dtype::kF8E5M2: return f(Tag<typename Types::f8e5m2>{});
  }
}

// Outputs are float32, bfloat16 or float16 (the Python layer casts to float8 afterwards).
template <typename Types, typename F>
void visit_output(Dtype d, F&& f) {
  switch (d) {
    case Dtype::kBF16: return f(Tag<typename Types::bf16>{});
    case Dtype::kF16: return f(Tag<typename Types::f16>{});
    default: return f(Tag<typename Types::f32>{});
  }
}

}  // namespace moe
