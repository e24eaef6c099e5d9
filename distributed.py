"""
torch.distributed in one room, as torchtitan keeps its parallelize apart: torchrun's processes and
their group, each rank's share of a batch, the global sums every normaliser goes through, DDP with
gradients summed over ranks, --grad_accum's micro-batches. In one process each is what it means
there (a share is the whole batch), so a script reads the same with torchrun or without. A Run
(plumbing.py) is a Distributed: run.shard, run.all_sum, run.mean, run.std, run.ddp, ...
"""
import contextlib
import math
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

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

    def join(self):
        """Under torchrun: this rank's device (cuda:LOCAL_RANK), the group (NCCL, or gloo)."""
        if self.world > 1:
            if self.device.startswith("cuda"):
                self.device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
                torch.cuda.set_device(self.device)
            if not dist.is_initialized():
                dist.init_process_group("nccl" if self.device.startswith("cuda") else "gloo")

    def leave(self, finished=False, code=0):
        """Tear the group down. finished: every rank is here; they wait for each other, then leave
        at once with `code` (DDP keeps gloo alive past destroy_process_group, and its teardown at
        interpreter exit can abort a finished run: 3 runs in 7 here)."""
        if self.world > 1 and dist.is_initialized():
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
        """The model in DDP for training, its gradient the SUM over ranks, not the mean: each rank's
        loss is its share of the batch's (normalised by all_sum counts), the shares one batch's."""
        if self.world == 1:
            return model
        wrapped = DistributedDataParallel(model)
        wrapped.register_comm_hook(None, _allreduce_sum)
        return wrapped

    def micro_batches(self, n, *ddp_models):
        """The rows of each --grad_accum micro-batch; forward and backward inside the loop body:
        every micro-batch but the last runs in the models' no_sync() (DDP decides at the forward
        whether its backward all-reduces), so gradients are summed over ranks once."""
        parts = torch.tensor_split(torch.arange(n, device=self.device), self.args.grad_accum)
        for i, rows in enumerate(parts):
            with contextlib.ExitStack() as stack:
                if self.world > 1 and i < len(parts) - 1:
                    for m in ddp_models:
                        stack.enter_context(m.no_sync())
                yield rows

    def barrier(self):
        if self.world > 1:
            dist.barrier()


def _allreduce_sum(state, bucket):
    """DDP's hook: a gradient bucket summed over ranks (DDP's default averages)."""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])
