# The CUTLASS sm90a grouped GEMM behind jax_moe_permute.ragged_dot, linked into _cuda.
# Built only when 90 is among CMAKE_CUDA_ARCHITECTURES and the nvidia-cutlass package (its C++
# headers) is importable; otherwise ragged_dot falls back to jax.lax.ragged_dot.
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

# One generated unit per (dtype, layout, tile); the tiles are defined in gemm/grouped_gemm_cutlass.cuh
# and chosen per call in gemm/ffi_grouped_gemm_cuda.cc. The weight gradient (M = K of the weights) uses
# the large tile only.
set(_moe_gemm_units cpp/gemm/grouped_gemm_setup.cu cpp/gemm/grouped_gemm_decode.cu cpp/gemm/moe_mlp_decode.cu
                     cpp/gemm/gather_gemm.cu cpp/gemm/grouped_wgrad.cu cpp/gemm/down_backward.cu)
foreach(_dtype Bf16 F16)
  foreach(_layout_tile IN ITEMS
          Forward:128x256 Forward:64x256 Forward:128x128 TransposedRhs:128x256 TransposedRhs:64x256
          TransposedRhs:128x128 WeightGrad:128x256 WeightGrad:64x256 WeightGrad:128x128)
    string(REPLACE ":" ";" _parts "${_layout_tile}")
    list(GET _parts 0 _layout)
    list(GET _parts 1 _tile)
    set(_unit "${CMAKE_CURRENT_BINARY_DIR}/grouped_gemm/${_dtype}_${_layout}_${_tile}.cu")
    file(CONFIGURE OUTPUT "${_unit}" CONTENT
         "#include \"gemm/grouped_gemm_cutlass.cuh\"\nMOE_GROUPED_GEMM_INSTANCE(moe::gemm::Dtype::k${_dtype}, moe::gemm::Layout::k${_layout}, moe::gemm::Tile::k${_tile})\n")
    list(APPEND _moe_gemm_units "${_unit}")
  endforeach()
endforeach()
add_library(moe_grouped_gemm_sm90a OBJECT ${_moe_gemm_units})
# wgmma and TMA need the arch-specific sm_90a target; without NDEBUG ptxas serializes wgmma.
set_target_properties(moe_grouped_gemm_sm90a PROPERTIES
  CUDA_ARCHITECTURES OFF CUDA_STANDARD 17 POSITION_INDEPENDENT_CODE ON)
target_compile_options(moe_grouped_gemm_sm90a PRIVATE
  -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -DNDEBUG)
target_include_directories(moe_grouped_gemm_sm90a PRIVATE
  "${PROJECT_SOURCE_DIR}/cpp" "${CUTLASS_SOURCE_DIR}/include" "${CUTLASS_SOURCE_DIR}/tools/util/include")

target_sources(_cuda PRIVATE cpp/gemm/ffi_grouped_gemm_cuda.cc cpp/gemm/ffi_gather_gemm_cuda.cc
                             cpp/gemm/ffi_grouped_wgrad_cuda.cc cpp/gemm/ffi_down_backward_cuda.cc)
target_link_libraries(_cuda PRIVATE moe_grouped_gemm_sm90a)
target_compile_definitions(_cuda PRIVATE MOE_HAS_GROUPED_GEMM)
