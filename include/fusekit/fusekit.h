// fusekit: fused forward and backward GPU kernels for transformer training.
#pragma once

#include "fusekit/error.h"
#include "fusekit/norm.h"
#include "fusekit/philox.h"
#include "fusekit/runtime.h"
#include "fusekit/tensor.h"
