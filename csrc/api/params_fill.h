// The parameters both directions share (FwdParams, and so the base of BwdParams), filled once
// from the op arguments: pointers, strides, sizes, scale / softcap / window, dropout, the lse
// layout. The caller sets p.lse (the forward allocates it, the backward reads it) and the
// direction's own fields.
#pragma once
#include <ATen/core/Tensor.h>

#include <optional>

#include "api/checks.h"
#include "params.h"

namespace flash_ext {

void fill_common_params(FwdParams& p, const AttnShape& s, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& out, const std::optional<at::Tensor>& cu_seqlens_q,
                        const std::optional<at::Tensor>& cu_seqlens_k, double softmax_scale, bool causal,
                        int64_t window_left, int64_t window_right, double softcap, double dropout_p,
                        const std::optional<at::Tensor>& rng_state);

// Dropout fields of the parameters (common/dropout.h) from the op arguments. rng_state: the
// int64 CPU tensor [seed, offset] that flash_ext::dropout_rng_state returned (read on the host:
// no device sync). dropout_p == 0 leaves dropout off (rng_state is then ignored).
void set_dropout_params(FwdParams& p, double dropout_p, const std::optional<at::Tensor>& rng_state);

}  // namespace flash_ext
