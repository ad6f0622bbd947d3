// fusekit: fused forward and backward GPU kernels for transformer training.
#pragma once

#include "fusekit/activation.h"
#include "fusekit/attention.h"
#include "fusekit/bias_act_dropout.h"
#include "fusekit/cross_entropy.h"
#include "fusekit/dropout.h"
#include "fusekit/error.h"
#include "fusekit/fp8_norm.h"
#include "fusekit/gated_act.h"
#include "fusekit/linear.h"
#include "fusekit/linear_cross_entropy.h"
#include "fusekit/norm.h"
#include "fusekit/philox.h"
#include "fusekit/rope.h"
#include "fusekit/runtime.h"
#include "fusekit/tensor.h"
