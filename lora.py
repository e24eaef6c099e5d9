"""
LoRA, from scratch: low-rank adapters on a model's projections, trained while its weights stay
frozen (Hu et al. 2021, arXiv 2106.09685). A projection y = W x (W: out x in) gets A (r x in) and
B (out x r), r << in, out:

    y = W x + (alpha / r) B A x              B = 0 at the start: the model starts as it was

Only A and B train: r (in + out) numbers per projection, not in x out. The reference policy of an
RL or preference run is the same weights with the adapters off (base_model: no second copy). On a
GPU the frozen W are kept in bfloat16 where that is exact (compact): half their memory. A
checkpoint holds weights and adapters; loaded as a model it is merged (W + (alpha / r) B A).

PEFT's choices, so that an exported adapter loads there: A initialised as nn.Linear's weight
(Kaiming-uniform; the paper: Gaussian), B zeros; no dropout, no biases, scale alpha / r. Targets
are Hugging Face's names of the projections a model has: q, k, v (rotary) or qkv (GPT-2's fused
c_attn), o, gate (gated MLPs), up, down; each part of a fused projection gets its own A and B.

    python grpo.py --init path/to/Qwen2.5-0.5B-Instruct --lora_rank 16 --lora_alpha 32
"""
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import operand_dtype

class LoRALinear(nn.Module):
    """A frozen nn.Linear `base` whose output, parts of widths `sizes` (q | k | v), gets
    (alpha / r) B_i A_i x added on the parts in `adapted`."""

    def __init__(self, base, sizes, names, adapted, rank, alpha):
        super().__init__()
        self.base, self.sizes, self.names = base, list(sizes), list(names)
        self.rank, self.alpha = rank, alpha
        self.scale = alpha / rank
        self.adapted = [n for n in names if n in adapted]
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        for name, size in zip(names, sizes):
            if name in adapted:
                a = torch.empty(rank, base.in_features, device=base.weight.device)
                nn.init.kaiming_uniform_(a, a=math.sqrt(5))        # nn.Linear's (and PEFT's) init
                self.lora_A[name] = nn.Parameter(a)
                self.lora_B[name] = nn.Parameter(torch.zeros(size, rank, device=base.weight.device))
        base.requires_grad_(False)

    in_features = property(lambda self: self.base.in_features)
    out_features = property(lambda self: self.base.out_features)

    def forward(self, x):
        W = self.base.weight                         # float32, or bfloat16 where it holds (compact)
        if W.dtype != x.dtype and operand_dtype(x.device.type, None) is None:
            W = W.to(x.dtype)                        # no autocast to cast it: the same numbers
        y = F.linear(x, W, self.base.bias)                                  # (..., out) W x
        if not self.adapted:
            return y
        A, B = self.stacked()                                         # (k r, in), (out, k r)
        h = x.flatten(0, -2) @ A.t()                                  # (N, k r) A x, every part
        # W x + (alpha/r) B A x in one product: B block-diagonal, each part's rows read its own A x
        return torch.addmm(y.flatten(0, -2), h, B.t(), alpha=self.scale).view_as(y)   # (..., out)

    def stacked(self):
        """The adapted parts' A on top of one another (k r, in) and their B as one block-diagonal
        (out, k r) matrix, zero rows for a part without an adapter: a fused projection's parts
        in two products, not two a part."""
        if len(self.names) == 1:
            return self.lora_A[self.names[0]], self.lora_B[self.names[0]]
        A = torch.cat([self.lora_A[n] for n in self.adapted])
        B = torch.block_diag(*(self.lora_B[n] if n in self.lora_A else A.new_zeros(size, 0)
                               for n, size in zip(self.names, self.sizes)))
        return A, B

    def delta_weight(self):
        """(alpha / r) B A of each part (zeros where none): merge's (out, in) float32 change."""
        rows = [self.scale * (self.lora_B[n].float() @ self.lora_A[n].float()) if n in self.lora_A
                else torch.zeros(size, self.base.in_features, device=self.base.weight.device)
                for n, size in zip(self.names, self.sizes)]
        return torch.cat(rows)


def compact(model):
    """The frozen W under the adapters in bfloat16 if each equals its rounding (a bfloat16
    checkpoint's, Qwen's): 0.67 GB less at Qwen2.5-0.5B. Autocast multiplies in these numbers and
    merges add in float32: no number moves (tests/test_lora.py). Returns whether it did."""
    weights = [m.base.weight for m in model.modules() if isinstance(m, LoRALinear)]
    if not weights or not all(torch.equal(w, w.bfloat16().float()) for w in weights):
        return False
    for w in weights:
        w.data = w.data.bfloat16()
    return True


def projections(model):
    """{target: [(parent module, attribute, part names, part widths)]}: a GPT's projections."""
    c, out = model.config, {}
    hs, kv = c.head_size, c.kv_heads
    for block in model.blocks:
        attn = block.attn
        if c.pos == "rope":
            fused = (attn, "c_attn", ("q", "k", "v"), (c.n_head * hs, kv * hs, kv * hs))
        else:
            fused = (attn, "c_attn", ("qkv",), (attn.c_attn.out_features,))
        mlp = block.mlp
        if c.mlp == "swiglu":
            hidden = mlp.c_fc.out_features // 2
            up = (mlp, "c_fc", ("gate", "up"), (hidden, hidden))
            down = (mlp, "c_proj", ("down",), (mlp.c_proj.out_features,))
        else:                                      # nn.Sequential(Linear, GELU, Linear, Dropout)
            up = (mlp, "0", ("up",), (mlp[0].out_features,))
            down = (mlp, "2", ("down",), (mlp[2].out_features,))
        for site in (fused, (attn, "c_proj", ("o",), (attn.c_proj.out_features,)), up, down):
            for name in site[2]:
                out.setdefault(name, []).append(site)
    return out


def check_targets(targets, allowed):
    """`targets` without repeats, or ValueError: one not `allowed`, or none."""
    targets = list(dict.fromkeys(targets))
    for t in targets:
        if t not in allowed:
            raise ValueError(f"--lora_targets {t!r} names no projection of this model; allowed: "
                             f"{', '.join(allowed)}")
    if not targets:
        raise ValueError(f"--lora_targets is empty; allowed: {', '.join(allowed)}")
    return targets


def add_adapters(model, rank, alpha, targets=None):
    """`model` (a GPT) with every weight frozen and rank-`rank` adapters on `targets` (None: every
    projection it has); ValueError for a target it lacks or a rank outside 1..min(in, out)."""
    sites = projections(model)
    targets = check_targets(list(sites) if targets is None else targets, tuple(sites))
    widths = [min(getattr(parent, attr).in_features, size)
              for t in targets for parent, attr, names, sizes in sites[t]
              for n, size in zip(names, sizes) if n == t]
    if not 1 <= rank <= min(widths):
        raise ValueError(f"--lora_rank {rank}; allowed: 1 to {min(widths)} (the narrowest targeted "
                         f"projection)")
    model.requires_grad_(False)
    done = set()
    for t in targets:
        for parent, attr, names, sizes in sites[t]:
            if (id(parent), attr) in done:
                continue
            done.add((id(parent), attr))
            adapted = LoRALinear(getattr(parent, attr), sizes, names, set(targets), rank, alpha)
            setattr(parent, attr, adapted)
    model.lora = {"rank": rank, "alpha": alpha, "targets": targets}
    return model


def adapters(model):
    """The adapters' parameters: what the optimiser trains."""
    return [p for m in model.modules() if isinstance(m, LoRALinear)
            for p in (*m.lora_A.values(), *m.lora_B.values())]


def trainable(model):
    """The parameters that train: the adapters where the model has them, else every parameter."""
    model = getattr(model, "module", model)                 # DistributedDataParallel's
    return adapters(model) if getattr(model, "lora", None) else list(model.parameters())


def base_model(model):
    """The model without adapters, its (frozen) tensors shared: the reference at no memory."""
    twin = copy.deepcopy(model, memo={id(p): p for p in model.parameters()})   # the same tensors
    for parent in list(twin.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LoRALinear):
                setattr(parent, name, child.base)                # nn.Sequential's children too
    twin.lora = None
    return twin


@torch.no_grad()
def merge(model):
    """A copy without adapters, W + (alpha / r) B A in float32 (a compact W's float32 value),
    every weight trainable."""
    merged = copy.deepcopy(base_model(model))                               # its own tensors now
    layers = dict(merged.named_modules())             # a LoRALinear's name is its base's there
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            w = layers[name].weight
            w.data = w.data.float() + m.delta_weight()
    return merged.requires_grad_(True)
