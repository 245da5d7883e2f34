# The CUTLASS sm90a grouped GEMM behind jax_moe_permute.ragged_dot, linked into _cuda.
# Built only when 90 is among CMAKE_CUDA_ARCHITECTURES and the nvidia-cutlass package (its C++
# headers) is importable; otherwise ragged_dot falls back to jax.lax.ragged_dot.
# One CUTLASS instantiation per translation unit so that they compile in parallel.
set(_moe_has_sm90 OFF)
foreach(_arch IN LISTS CMAKE_CUDA_ARCHITECTURES)
  if(_arch MATCHES "^90")
    set(_moe_has_sm90 ON)
  endif()
endforeach()

if(NOT _moe_has_sm90)
  message(STATUS "Grouped GEMM: skipped (90 is not in CMAKE_CUDA_ARCHITECTURES)")
  return()
endif()

execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
          "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source'))"
  OUTPUT_STRIP_TRAILING_WHITESPACE OUTPUT_VARIABLE CUTLASS_SOURCE_DIR
  RESULT_VARIABLE _moe_cutlass_result ERROR_QUIET)
if(NOT _moe_cutlass_result EQUAL 0 OR NOT EXISTS "${CUTLASS_SOURCE_DIR}/include/cutlass/cutlass.h")
  message(STATUS "Grouped GEMM: skipped (pip install nvidia-cutlass for the CUTLASS headers)")
  return()
endif()
message(STATUS "Grouped GEMM: CUTLASS headers from ${CUTLASS_SOURCE_DIR}")

add_library(moe_grouped_gemm_sm90a OBJECT
  cpp/grouped_gemm_setup.cu
  cpp/grouped_gemm_bf16_forward.cu
  cpp/grouped_gemm_bf16_transposed_rhs.cu
  cpp/grouped_gemm_bf16_weight_grad.cu
  cpp/grouped_gemm_f16_forward.cu
  cpp/grouped_gemm_f16_transposed_rhs.cu
  cpp/grouped_gemm_f16_weight_grad.cu)
# wgmma and TMA need the arch-specific sm_90a target; without NDEBUG ptxas serializes wgmma.
set_target_properties(moe_grouped_gemm_sm90a PROPERTIES
  CUDA_ARCHITECTURES OFF CUDA_STANDARD 17 POSITION_INDEPENDENT_CODE ON)
target_compile_options(moe_grouped_gemm_sm90a PRIVATE
  -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -DNDEBUG)
target_include_directories(moe_grouped_gemm_sm90a PRIVATE
  cpp "${CUTLASS_SOURCE_DIR}/include" "${CUTLASS_SOURCE_DIR}/tools/util/include")

target_sources(_cuda PRIVATE cpp/ffi_grouped_gemm_cuda.cc)
target_link_libraries(_cuda PRIVATE moe_grouped_gemm_sm90a)
target_compile_definitions(_cuda PRIVATE MOE_HAS_GROUPED_GEMM)
