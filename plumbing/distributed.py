"""
torch.distributed in one room, as torchtitan keeps its parallelize apart: torchrun's processes and
their group, each rank's share of a batch, the global sums every normaliser goes through, DDP or
FSDP2 with gradients summed over ranks, --grad_accum's micro-batches, the gradient's global norm.
In one process each is what it means there, so a script reads the same with torchrun or without.
A Run (plumbing/run.py) is a Distributed: run.shard, run.all_sum, run.ddp, ...

--fsdp (FSDP2's fully_shard; Zhao et al. 2023, arXiv 2304.11277): run.ddp returns a twin whose
weights, gradients and AdamW moments are split over the ranks, each block a unit gathered only
while it computes, then the root (embedding, final norm, head: tied weights share a unit). The model
itself stays whole for what runs without gradient (sampling, scoring, evaluation), refreshed from
the twin after each optimizer step (follow). Gathers are float32 and autocast computes in bfloat16,
as one process does; checkpoints hold the whole state (docs/distributed.md says why).
"""
import contextlib
import copy
import math
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from model import Block

# what a collective raises when another process of the run is gone (gloo, NCCL)
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
             "NCCL communicator was aborted", "remote process exited or there was a network error")


class Distributed:
    """world, rank, is_main (rank 0 alone locks, prints, logs, saves); uses device and args."""

    def processes(self, solo=False):
        """As torchrun sets them; solo: this process alone (async_grpo.py's learner)."""
        self.world, self.rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
        if solo:
            self.world, self.rank = 1, 0
        self.is_main = self.rank == 0
        self.sharded = getattr(self.args, "fsdp", False)
        self.twins = {}                                  # id(model) -> (model, its FSDP twin)

    def join(self):
        """Under torchrun: this rank's device (cuda:LOCAL_RANK), the group (NCCL, or gloo); with
        --fsdp in one process, a group of one (a single shard: the same code path)."""
        if self.world > 1 or self.sharded:
            if self.device.startswith("cuda"):
                self.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
                torch.cuda.set_device(self.device)
            backend = "nccl" if self.device.startswith("cuda") else "gloo"
            if not dist.is_initialized() and self.world > 1:
                dist.init_process_group(backend)
            elif not dist.is_initialized():
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)

    def leave(self, finished=False, code=0):
        """Tear the group down. finished: every rank is here; they wait for each other, then leave
        at once with `code` (DDP keeps gloo alive past destroy_process_group, and its teardown at
        interpreter exit can abort a finished run: 3 runs in 7 here)."""
        if (self.world > 1 or self.sharded) and dist.is_initialized():
            if finished:
                dist.barrier()
            dist.destroy_process_group()
            if finished:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)

    def gather(self, x):
        """[x of every rank] (a picklable object), in rank order."""
        if self.world == 1:
            return [x]
        out = [None] * self.world
        dist.all_gather_object(out, x)
        return out

    def peer_gone(self, error):
        """Whether a collective raised `error` because another process is gone."""
        return self.world > 1 and isinstance(error, RuntimeError) and \
            any(words in str(error) for words in PEER_GONE)

    def launcher(self):
        """The command that started this process: python, or torchrun and its counts."""
        if self.world == 1:
            return "python"
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        if local == self.world:
            return f"torchrun --standalone --nproc_per_node {local}"
        return (f"torchrun --nnodes {self.world // local} --nproc_per_node {local} <this run's "
                f"rendezvous flags>")

    def shard(self, items):
        """This rank's contiguous share of a list every rank drew alike (a group never splits)."""
        n = len(items) // self.world
        return items[self.rank * n:(self.rank + 1) * n]

    def all_sum(self, x):
        """x (a tensor or number) summed over ranks, a tensor: every normaliser and metric."""
        x = x if torch.is_tensor(x) else torch.tensor(float(x), device=self.device)
        if self.world == 1:
            return x
        x = x.detach().clone()
        dist.all_reduce(x)
        return x

    def max(self, x):
        """The largest of x's elements over every rank, a float."""
        x = x.detach().max().clone()
        if self.world > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return x.item()

    def mean(self, x, mask=None):
        """The mean of x's elements over every rank (where mask is 1), a float: for metrics."""
        if mask is None:
            return (self.all_sum(x.sum()) / self.all_sum(x.numel())).item()
        total = self.all_sum(torch.where(mask > 0, x, 0.0).sum())
        return (total / self.all_sum(mask.sum()).clamp(min=1)).item()

    def std(self, x):
        """The population std of x's elements over every rank, a float."""
        if self.world == 1:
            return x.std(unbiased=False).item()
        return math.sqrt(self.mean((x - self.mean(x)) ** 2))

    def ddp(self, model):
        """The model to train: in DDP under torchrun, its FSDP twin with --fsdp (fsdp), else itself.
        Its gradient is the SUM over ranks, not the mean: each rank's loss is its share of the
        batch's (normalised by all_sum counts), the shares one batch's."""
        if self.sharded:
            return self.fsdp(model)
        if self.world == 1:
            return model
        wrapped = DistributedDataParallel(model)
        wrapped.register_comm_hook(None, _allreduce_sum)
        return wrapped

    def fsdp(self, model):
        """The FSDP2 twin of `model` (module docstring), filled from its weights; `model` becomes
        the whole copy that follow() keeps up to date."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard
        # the twin's structure with every tensor on the meta device (no memory), then sharded
        meta = {id(t): torch.nn.Parameter(torch.empty_like(t, device="meta"), t.requires_grad)
                for t in model.parameters()}
        twin = copy.deepcopy(model, memo=meta)
        # the forward's outputs are read, never changed in place (FSDP warns of a returned view)
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
        mesh = init_device_mesh(torch.device(self.device).type, (self.world,))
        for block in [m for m in twin.modules() if isinstance(m, Block)]:
            fully_shard(block, mesh=mesh)           # one all-gather per block, freed after
        fully_shard(twin, mesh=mesh)                # the root: embedding, final norm, head
        twin.to_empty(device=self.device)
        for m in twin.modules():
            if isinstance(m, FSDPModule):           # reduce-scatter sums, as DDP's hook does
                divide = getattr(m, "set_gradient_divide_factor", None) or \
                    m.set_reduce_scatter_divide_factor                  # (its name before 2.8)
                divide(1.0)
                if hasattr(m, "set_force_sum_reduction_for_comms"):     # a plain SUM: gloo's only
                    m.set_force_sum_reduction_for_comms(True)
        load_sharded(twin, model.state_dict())
        if self.device.startswith("cuda") and not getattr(model, "lora", None):
            for block in [m for m in model.modules() if isinstance(m, Block)]:
                for m in block.modules():           # the whole copy: its blocks' linears bf16
                    if isinstance(m, torch.nn.Linear):
                        m.to(torch.bfloat16)
        model.requires_grad_(False)
        self.twins[id(model)] = (model, twin)
        return twin

    def follow(self, optimizer):
        """After each step of `optimizer`, every --fsdp model made whole from its twin's shards,
        a trained tensor at a time (the peak: the copy and one tensor)."""
        def refresh(*_):
            with torch.no_grad():
                for model, twin in self.twins.values():
                    whole = dict(model.named_parameters())
                    for name, p in twin.named_parameters():
                        if p.requires_grad:
                            whole[name].copy_(p.full_tensor())
        if self.twins:
            optimizer.register_step_post_hook(refresh)

    def whole_state(self, model):
        """model.state_dict() as one process holds it; an --fsdp model's gathered from its twin a
        tensor at a time into rank 0's host memory (every rank calls it)."""
        if id(model) not in self.twins:
            return model.state_dict()
        return _gathered(self.twins[id(model)][1].state_dict(keep_vars=True), self.is_main)

    def whole_optimizer_state(self, optimizer):
        """optimizer.state_dict() as one process's, its sharded moments gathered as whole_state
        (without --fsdp: the optimizer, whose state_dict() the writer takes)."""
        if not self.twins:
            return optimizer
        state = optimizer.state_dict()
        return {**state, "state": {i: _gathered(s, self.is_main)
                                   for i, s in state["state"].items()}}

    def load_whole(self, model, state, optimizer=None, optimizer_state=None):
        """Load a whole state (a checkpoint's) into `model` and, with --fsdp, its twin's shards;
        optimizer_state into `optimizer`, its moments sharded as their parameters are."""
        model.load_state_dict(state)
        if id(model) in self.twins:
            load_sharded(self.twins[id(model)][1], state)
        if optimizer is None:
            return
        if self.twins:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            optimizer_state = {**optimizer_state, "state": {
                i: {k: _like(v, params[int(i)]) for k, v in s.items()}
                for i, s in optimizer_state["state"].items()}}
        optimizer.load_state_dict(optimizer_state)

    def clip_grad_norm(self, model, max_norm):
        """Clip the gradient of `model` to max_norm by its global 2-norm, returned (pre-clip); a
        twin's from every rank's shards (a norm per shard would clip each by another factor). A
        norm that is not finite stops the run (check_finite) before any optimizer applies it."""
        if id(model) not in {id(t) for _, t in self.twins.values()}:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            self.check_finite(norm, f"lower --lr (now {getattr(self.args, 'lr', '?')})",
                              "the gradient's norm")
            return norm
        grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
        squares = sum((g.float().pow(2).sum() for g in grads), torch.zeros((), device=self.device))
        norm = self.all_sum(squares).sqrt()                           # || g ||_2 over all ranks
        self.check_finite(norm, f"lower --lr (now {getattr(self.args, 'lr', '?')})",
                          "the gradient's norm")
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
        return norm

    def micro_batches(self, n, *ddp_models):
        """The rows of each --grad_accum micro-batch; forward and backward inside the loop body:
        every micro-batch but the last runs in the DDP models' no_sync() (DDP decides at the
        forward whether its backward all-reduces), so gradients are summed over ranks once; an FSDP
        twin reduce-scatters each micro-batch's (its shards add them up)."""
        parts = torch.tensor_split(torch.arange(n, device=self.device), self.args.grad_accum)
        for i, rows in enumerate(parts):
            with contextlib.ExitStack() as stack:
                if self.world > 1 and i < len(parts) - 1:
                    for m in ddp_models:
                        if isinstance(m, DistributedDataParallel):
                            stack.enter_context(m.no_sync())
                yield rows

    def barrier(self):
        if self.world > 1:
            dist.barrier()


def load_sharded(twin, state):
    """Each of the twin's tensors takes its shard of the whole one in `state` (held by every rank),
    as fully_shard splits them (torch.chunk along dim 0)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    with torch.no_grad():
        for name, p in twin.state_dict().items():
            local = p.to_local() if hasattr(p, "to_local") else p
            chunks = state[name].chunk(world, dim=0) if state[name].dim() else [state[name]] * world
            mine = chunks[rank] if rank < len(chunks) else state[name][:0]
            local.copy_(mine.to(local.device))


def _like(value, param):
    """An optimizer moment (whole) as its parameter is held: sharded where the parameter is."""
    if not hasattr(param, "device_mesh") or not torch.is_tensor(value) or value.dim() == 0:
        return value
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(value.to(param.device), param.device_mesh, param.placements)


def _gathered(state, keep):
    """A state dict's sharded tensors made whole on the CPU one at a time (a collective), kept
    where `keep`; tied tensors stay tied."""
    out, seen = {}, {}
    for k, v in state.items():
        if torch.is_tensor(v) and id(v) not in seen:
            whole = v.full_tensor() if hasattr(v, "full_tensor") else v
            seen[id(v)] = whole.detach().cpu() if keep else None
        out[k] = seen[id(v)] if torch.is_tensor(v) else v
    return out


def _allreduce_sum(state, bucket):
    """DDP's hook: a gradient bucket summed over ranks (DDP's default averages)."""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])
