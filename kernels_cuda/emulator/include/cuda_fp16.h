// Under the CPU emulator, <cuda_fp16.h> is the emulated runtime (see ../cuda_runtime_emulated.h).
#pragma once
#include "../cuda_runtime_emulated.h"
