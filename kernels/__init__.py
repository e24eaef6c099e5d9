"""Fused, exact kernels for the token log-prob path of RL on language models.

    from kernels import logprobs, kl, entropy

    logprobs(logits, targets, T=1.0) -> float32 [...]   log softmax(logits / T)[targets]
    kl(logits_p, logits_q, T=1.0)    -> float32 [...]   exact KL(softmax(p/T) || softmax(q/T)) over V
    entropy(logits, T=1.0)           -> float32 [...]   H(softmax(logits / T)) = -sum p log p

logits are [..., V] in float32, bfloat16 or float16, with any strides (a slice such as
`model(idx)[:, :-1]` is read in place, not copied). All three accumulate in float32, are
differentiable w.r.t. their (first) logits, return the gradient in the logits' dtype, and never
keep an [N, V] tensor for backward: each keeps the logits by reference and O(N) floats per row
(the row's max and log-sum), and recomputes the softmax in backward. `kl` gives no gradient to
logits_q, the frozen reference, and refuses a logits_q that requires grad.

Dispatch, read per call from the tensor's device:
  - CUDA tensors -> Triton kernels (`*_triton`);
  - any tensor, when TRITON_INTERPRET=1 was set before `kernels` was imported -> the same
    Triton kernels run by Triton's interpreter (numpy on the CPU: slow, for tests);
  - otherwise (CPU, MPS, or Triton not installed) -> the PyTorch path (`*_torch`): an autograd
    Function that works through rows in ~32 MB chunks.
Both paths are exported so that either can be called, or tested, directly.

Files, each in the Triton-tutorial shape (reference, PyTorch path, kernels, launchers, autograd
wrapper, dispatch): logprobs.py, kl.py, entropy.py. common.py holds what the three share and
that is not math: the optional Triton import, the dispatch rule, argument checks, and the
[..., V] -> rows bookkeeping. The online-logsumexp loop is written out in each kernel on purpose,
so that each file reads top to bottom on its own (and copies out with common.py alone).
"""

from .common import HAS_TRITON, TRITON_INTERPRET
from .entropy import entropy, entropy_reference, entropy_torch, entropy_triton
from .kl import kl, kl_reference, kl_torch, kl_triton
from .logprobs import logprobs, logprobs_reference, logprobs_torch, logprobs_triton

__all__ = [
    "logprobs", "kl", "entropy",
    "logprobs_torch", "kl_torch", "entropy_torch",
    "logprobs_triton", "kl_triton", "entropy_triton",
    "logprobs_reference", "kl_reference", "entropy_reference",
    "HAS_TRITON", "TRITON_INTERPRET",
]
