// Programmatic dependent launch (sm_90): a kernel launched while the previous kernel in the stream
// drains. It waits for that kernel's results inside (griddepcontrol.wait, see
// device_vector.cuh's wait_for_prerequisite_grid), which hides the launch gap and the previous
// grid's tail. Where the driver refuses such a launch, a plain launch (stream order) does the
// same work; a real launch error is left for check_launch to report.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace fusekit::detail {

template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream,
                      Args... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  if (cudaLaunchKernelEx(&config, kernel, args...) != cudaSuccess) {
    cudaGetLastError();  // clear the refusal
    kernel<<<grid, block, smem, stream>>>(args...);
  }
}

}  // namespace fusekit::detail
