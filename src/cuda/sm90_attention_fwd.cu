// mxmla — attention forward for SM90 (placeholder while the kernel is written).
#include "common/attention_ops.h"

namespace mxmla::detail {

bool attention_cuda_supports(int64_t Dqk, int64_t Dv) { return (Dqk == 192 || Dqk == 128) && Dv == 128; }
void attention_fwd_cuda(const AttentionProblem&, Stream) {
  throw Error("mxmla.attention", "q", "the SM90 attention kernel is not built yet");
}

}  // namespace mxmla::detail
