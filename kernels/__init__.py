"""Fused, exact kernels for the token log-prob path of RL on language models.

    from kernels import logprobs, kl, entropy, linear_logprobs, kl_penalty

    logprobs(logits, targets, temp=1.0)    log softmax(logits / temp)[targets]
    kl(logits_p, logits_q, temp=1.0)       exact KL(softmax(p/temp) || softmax(q/temp)) over V
    entropy(logits, temp=1.0)              H(softmax(logits / temp)) = -sum p log p
    linear_logprobs(hidden, weight, targets, temp=1.0)
                                           log softmax((hidden @ weight.T) / temp)[targets]
    kl_penalty(logp, ref_logp, estimator)  one-sample k1/k2/k3 estimates of KL from sampled tokens'
                                           log-probs (plain PyTorch; kl_penalty.py)

Shapes use the scripts' letters: B batch, T time, V vocabulary, C channels (hidden width), N = B * T
token positions; the temperature is `temp`. logits are [..., V] in float32, bfloat16 or float16,
with any strides (a slice such as `model(idx)[:, :-1]` is read in place, not copied: the kernels see
it as N rows through a [B, T, V] view). All four accumulate in float32, return float32 [...] (the
inputs' shape less its last dim), are differentiable w.r.t. their (first) inputs, return gradients
in the inputs' dtype, and never keep an [N, V] tensor for backward: each keeps its inputs by
reference and O(N) floats per row (the row's max and log_sum), and recomputes the softmax in
backward. `kl` gives no gradient to logits_q, the frozen reference, and refuses a logits_q that
requires grad.

linear_logprobs goes one step further and never stores the logits at all: it takes the final
hidden states and the LM head's weight (Cut Cross-Entropy, Wijmans et al. 2024, arXiv:2411.09009).
With this repository's model.GPT (weight tied to the embedding):

    h = model.hidden(idx, mask)                                            # [B, T, C]
    logp = linear_logprobs(h[:, :-1], model.lm_head.weight, idx[:, 1:])     # [B, T-1], float32

Edge cases, the same on both paths (each file's docstring has its own list; the table EDGE_CASES
in tests/test_kernels.py checks every one on both paths):
  - NaN is never hidden: a NaN or +inf logit in a row gives NaN for that row's value and its
    whole gradient row (and, for linear_logprobs, a NaN or inf in hidden_n does so for token n);
    other rows are unaffected.
  - -inf logits are probability 0 (0 log 0 = 0). A target at a -inf logit has log-prob -inf with
    a finite gradient; a q = 0 < p gives KL = +inf; a row of all -inf is NaN.
  - the temperature must lie in [MIN_TEMPERATURE, MAX_TEMPERATURE] = [1e-3, 1e3], else
    ValueError (common.py explains the range; the training scripts' sampling range, 0.05 to 20,
    lies inside it).
  - out-of-range targets: ValueError on the PyTorch path, NaN on the Triton path (no host sync).

Dispatch, read per call from the tensor's device:
  - CUDA tensors -> Triton kernels (`*_triton`);
  - any tensor, when TRITON_INTERPRET=1 was set before `kernels` was imported -> the same
    Triton kernels run by Triton's interpreter (numpy on the CPU: slow, for tests);
  - otherwise (CPU, MPS, or Triton not installed) -> the PyTorch path (`*_torch`): an autograd
    Function that works through rows (and for linear_logprobs, vocabulary) in ~32 MB chunks.
Both paths are exported so that either can be called, or tested, directly.

Files, each in the Triton-tutorial shape (reference, PyTorch path, kernels, launchers, autograd
wrapper, dispatch, and a self-check run by `python -m kernels.<file>`): logprobs.py, kl.py,
entropy.py, linear_logprobs.py. common.py holds what they share and that is not math: the
optional Triton import, the dispatch rule, argument checks, the temperature range, and the
[..., V] -> rows bookkeeping. The online-logsumexp loop is written out in each kernel on
purpose, so that each file reads top to bottom on its own (and copies out with common.py alone).
"""

from .common import HAS_TRITON, MAX_TEMPERATURE, MIN_TEMPERATURE, TRITON_INTERPRET
from .entropy import entropy, entropy_reference, entropy_torch, entropy_triton
from .kl import kl, kl_reference, kl_torch, kl_triton
from .kl_penalty import kl_penalty
from .linear_logprobs import (linear_logprobs, linear_logprobs_reference, linear_logprobs_torch,
                              linear_logprobs_triton)
from .logprobs import logprobs, logprobs_reference, logprobs_torch, logprobs_triton

__all__ = [
    "logprobs", "kl", "entropy", "linear_logprobs", "kl_penalty",
    "logprobs_torch", "kl_torch", "entropy_torch", "linear_logprobs_torch",
    "logprobs_triton", "kl_triton", "entropy_triton", "linear_logprobs_triton",
    "logprobs_reference", "kl_reference", "entropy_reference", "linear_logprobs_reference",
    "HAS_TRITON", "TRITON_INTERPRET", "MIN_TEMPERATURE", "MAX_TEMPERATURE",
]
