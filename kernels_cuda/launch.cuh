// The one seam between the host launchers and the CPU emulator (kernels_cuda/emulator/):
//
//   VFS_LAUNCH(kernel, grid, block, smem, stream)(args...);
//
// is `kernel<<<grid, block, smem, stream>>>(args...)` under nvcc. Under g++ the emulator's
// cuda_runtime.h has defined it already, as a call that runs the grid on host threads, so the
// launchers (grid sizes, dispatch, shared-memory opt-in, error codes) are compiled and tested
// on CPU-only machines too. `kernel` must be one name (no template commas): bind a template
// instance to a local first, e.g. `const auto kernel = my_kernel<T, N>;`.
#pragma once

#include <cuda_runtime.h>

#ifndef VFS_LAUNCH
#define VFS_LAUNCH(kernel, grid, block, smem, stream) kernel<<<(grid), (block), (smem), (stream)>>>
#endif
