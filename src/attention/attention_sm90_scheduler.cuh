// The Hopper attention kernels' tile schedulers: which tile a CTA computes.
#pragma once

#include "attention/attention_params.h"

namespace fusekit::attention::sm90 {

// The forward's query block: blocks in reverse order, so that under a causal mask the last
// blocks, which see the most keys, start first and the grid's tail is short.
__device__ __forceinline__ int forward_query_block() { return gridDim.x - 1 - blockIdx.x; }

// The (batch, kv head, key block) of a dK / dV CTA: CTAs come in groups of `group_size` (kv head,
// batch) pairs, key-block major within a group. Under a causal mask the first key blocks are the
// heaviest (they see every query): each group starts with them and ends with light ones, which
// fill the grid's last wave. The launcher sizes the groups so that a group's Q and dO (read by
// each of its key blocks) stay in L2; 1 without a mask (the key blocks of a pair adjacent).
__device__ __forceinline__ void dkdv_block_of(const kernels::KernelParams& p, int block_keys, int group_size, int cta,
                                              int& b, int& hk, int& jb) {
  const int key_blocks = (p.seqlen_k + block_keys - 1) / block_keys, pairs = p.heads_kv * p.batch;
  const int group = cta / (group_size * key_blocks), in_group = cta % (group_size * key_blocks);
  const int group_pairs = min(group_size, pairs - group * group_size);
  jb = in_group / group_pairs;
  const int pair = group * group_size + in_group % group_pairs;
  hk = pair % p.heads_kv;
  b = pair / p.heads_kv;
}

}  // namespace fusekit::attention::sm90
