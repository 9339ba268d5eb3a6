// Under the CPU emulator, <vector_types.h> is the emulated runtime (see ../cuda_runtime_emulated.h).
#pragma once
#include "../cuda_runtime_emulated.h"
