"""
Device memory parking: what a step does not use waits in host memory (pinned, for a CUDA device)
and comes back when it is used, the numbers the same bit for bit. A frozen model (a reference, a
reward model: Parked) is on the device only inside `with parked:`; with --offload_optimizer
AdamW's two moments (ParkedMoments) only while a chunk of parameters is stepped. As verl's
ref.fsdp_config.param_offload and actor optimizer_offload. Run (plumbing/run.py) decides where they
act: on a GPU only.
"""
import torch


class Parked:
    """A frozen model's weights in device memory only inside `with parked:`; outside it they wait
    in host memory (pinned, for a CUDA device), as verl's ref.fsdp_config.param_offload. The
    tensors stay: their storage shrinks to nothing and grows back (sampler.release_copy), so the
    numbers are the same bit for bit. One host-to-device copy each time (1.17 GB at
    Qwen2.5-0.5B with bf16_linears), in exchange for that memory through sampling and update."""

    def __init__(self, model):
        storages = {}
        for p in model.parameters():
            storages.setdefault(p.untyped_storage().data_ptr(), p.untyped_storage())
        self.storages = list(storages.values())                   # a tied weight's once
        pin = self.storages[0].device.type == "cuda" if self.storages else False
        self.host = [torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=pin)
                     for s in self.storages]
        for s, h in zip(self.storages, self.host):
            h.untyped_storage().copy_(s)
        self.__exit__()

    def __enter__(self):
        for s, h in zip(self.storages, self.host):
            s.resize_(h.numel())
            s.copy_(h.untyped_storage(), non_blocking=True)      # ordered before the stream's use
        return self

    def __exit__(self, *exc):
        for s in self.storages:
            s.resize_(0)


class ParkedMoments:
    """An optimizer's state (AdamW's two moments, twice the trainable weights) in host memory
    (pinned for a CUDA device) outside its step (--offload_optimizer), as verl's actor
    optimizer_offload: on the device its storage shrinks to nothing. optimizer.step, replaced by
    self.step, runs a chunk of parameters at a time (about chunk_bytes): a chunk's moments are
    copied in, stepped and copied out before the next chunk's come in, so at most one chunk's
    moments and AdamW's temporaries are on the device. `with` brings them all back (a checkpoint).
    AdamW's update is elementwise: the same numbers bit for bit. Two copies a step (3.7 GiB each way
    at Qwen2.5-0.5B); on one stream each is ordered before any later use of that memory, so the host
    never waits."""

    def __init__(self, optimizer, chunk_bytes=2**28):
        self.optimizer, self.chunk_bytes, self.host, self.away = optimizer, chunk_bytes, {}, {}
        self.real_step, optimizer.step = optimizer.step, self.step
        self.leave()                                      # a resumed run's moments leave now

    def step(self, closure=None):
        """The optimizer's own step (its hooks too) once a chunk, the other parameters hidden."""
        if closure is not None:
            raise ValueError("--offload_optimizer steps without a closure")
        groups = self.optimizer.param_groups
        every = [g["params"] for g in groups]
        try:
            for chunk in self.chunks(every):
                for g, params in zip(groups, every):
                    g["params"] = [p for p in params if id(p) in chunk]
                self.come_back(chunk)
                self.real_step()
                self.leave(chunk)
        finally:
            for g, params in zip(groups, every):
                g["params"] = params

    def chunks(self, every):
        chunk, size = set(), 0
        for p in (p for params in every for p in params):
            if chunk and size + p.nbytes > self.chunk_bytes:
                yield chunk
                chunk, size = set(), 0
            chunk.add(id(p))
            size += p.nbytes
        if chunk:
            yield chunk

    def __enter__(self):
        self.come_back()
        return self

    def __exit__(self, *exc):
        self.leave()

    def come_back(self, chunk=None):
        for key, (p, t, h) in list(self.away.items()):
            if chunk is None or id(p) in chunk:
                del self.away[key]
                if self.optimizer.state.get(p, {}).get(key[1]) is t:   # not replaced (cleared)
                    t.untyped_storage().resize_(h.numel())
                    t.untyped_storage().copy_(h.untyped_storage(), non_blocking=True)

    def leave(self, chunk=None):
        for p, state in self.optimizer.state.items():
            if chunk is not None and id(p) not in chunk:
                continue
            for k, t in state.items():                    # AdamW: exp_avg, exp_avg_sq (not step)
                if not torch.is_tensor(t) or t.dim() == 0 or not t.untyped_storage().nbytes():
                    continue                              # a step count, or away already
                if not t.untyped_storage().resizable():  # e.g. loaded from a file on the CPU
                    state[k] = t = t.clone()
                s = t.untyped_storage()
                h = self.host.get((id(p), k))
                if h is None or h.numel() != s.nbytes():
                    h = torch.empty(s.nbytes(), dtype=torch.uint8,
                                    pin_memory=s.device.type == "cuda")
                    self.host[id(p), k] = h
                h.untyped_storage().copy_(s, non_blocking=True)
                s.resize_(0)
                self.away[id(p), k] = (p, t, h)
