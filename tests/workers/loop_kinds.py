"""The loop shapes of the rollback matrix (issue 39): what one step computes, loop by loop.

Each shape owns its models, optimizers and whatever else a step touches (a GradScaler, a
scheduler, an EMA copy), registers them as state, and splits a constant-global-batch step into
``gradients`` (forward and backward, with the step's collectives; ``fire`` names the kill points
inside it) and ``update`` (what goes in the ``commit_step()`` block, or before a snapshot
commit; ``fire("block")`` right after the first ``optimizer.step()``). Used only by
tests/workers/loop_shapes.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from elastic import ElasticState
from elastic.state import RNGState

Fire = Callable[[str], None]
HIDDEN = 8


def mlp(dtype: torch.dtype, inputs: int = 8, outputs: int = 1, norm: bool = False,
        dropout: float = 0.0) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = [torch.nn.Linear(inputs, HIDDEN, dtype=dtype)]
    if norm:
        layers.append(torch.nn.BatchNorm1d(HIDDEN, dtype=dtype))
    layers.append(torch.nn.Tanh())
    if dropout:
        layers.append(torch.nn.Dropout(dropout))
    layers.append(torch.nn.Linear(HIDDEN, outputs, dtype=dtype))
    return torch.nn.Sequential(*layers)


def squared_error(pred: torch.Tensor, y: torch.Tensor, scale: float, fire: Fire) -> torch.Tensor:
    """The rank's summed loss weighted for the global batch; its backward fires ``backward``
    before any gradient of a parameter exists (the peers then wait in the all-reduce)."""
    if pred.requires_grad:
        pred.register_hook(lambda grad: fire("backward") or grad)
    return ((pred.squeeze(-1) - y) ** 2).sum() * scale


class Plain:
    """``zero_grad()`` before the backward, SGD with momentum: the loop the older tests run."""

    dtype = torch.float64

    def __init__(self) -> None:
        self.model = mlp(self.dtype)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)

    def objects(self) -> dict[str, object]:
        return {"model": self.model, "optimizer": self.opt}

    def wrap(self, s: ElasticState) -> None:
        """Builds this round's DDP modules (with ``s.ddp``, which skips DDP's broadcast of the
        parameters the formation made the same on every rank)."""
        self.ddp = s.ddp(self.model)

    def loss(self, x, y, scale, fire: Fire) -> torch.Tensor:
        return squared_error(self.ddp(x.to(self.dtype)), y.to(self.dtype), scale, fire)

    def gradients(self, batch, scale, fire: Fire) -> None:
        x, y, _ = batch
        self.opt.zero_grad()
        self.loss(x, y, scale, fire).backward()

    def update(self, fire: Fire) -> None:
        self.opt.step()
        fire("block")

    def compared(self) -> list[torch.Tensor]:
        """Every tensor of the state a step changes, compared with the uninterrupted run."""
        return [t for obj in self.objects().values() if isinstance(obj, torch.nn.Module)
                for t in obj.state_dict().values()] + [
            t for obj in self.objects().values() if isinstance(obj, torch.optim.Optimizer)
            for s in obj.state_dict()["state"].values() for t in s.values()
            if isinstance(t, torch.Tensor)]


class Amp(Plain):
    """The AMP recipe: ``scaler.scale(loss).backward()``, ``unscale_``, ``clip_grad_norm_``,
    then ``scaler.step(opt)`` and ``scaler.update()`` in the block (CPU GradScaler)."""

    autocast = False

    def __init__(self) -> None:
        super().__init__()
        self.scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=3)

    def objects(self) -> dict[str, object]:
        return {**super().objects(), "scaler": self.scaler}

    def gradients(self, batch, scale, fire: Fire) -> None:
        x, y, _ = batch
        self.opt.zero_grad()
        with (torch.autocast("cpu", dtype=torch.bfloat16) if self.autocast
              else contextlib.nullcontext()):
            loss = self.loss(x, y, scale, fire)
        self.scaler.scale(loss.float() if self.autocast else loss).backward()
        self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=0.5)

    def update(self, fire: Fire) -> None:
        self.scaler.step(self.opt)
        fire("block")
        self.scaler.update()

    def compared(self) -> list[torch.Tensor]:
        return super().compared() + [self.scaler.get_scale() * torch.ones(1)]


class AmpBfloat16(Amp):
    """The AMP recipe with a ``torch.autocast("cpu", dtype=torch.bfloat16)`` forward (float32
    parameters: autocast leaves float64 alone); compared with its own uninterrupted run."""

    dtype = torch.float32
    autocast = True


class Accumulate(Plain):
    """Gradient accumulation: 4 micro-batches, the first 3 under ``no_sync()``, one step, and
    ``zero_grad()`` after it; ``micro`` fires between the second and the third."""

    MICRO = 4

    def gradients(self, batch, scale, fire: Fire) -> None:
        x, y, _ = batch
        xs, ys = torch.tensor_split(x, self.MICRO), torch.tensor_split(y, self.MICRO)
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            last = i == self.MICRO - 1
            with contextlib.nullcontext() if last else self.ddp.no_sync():
                self.loss(xm, ym, scale, fire if last else lambda where: None).backward()
            if i == 1:
                fire("micro")

    def update(self, fire: Fire) -> None:
        super().update(fire)
        self.opt.zero_grad()


class ZeroAfter(Plain):
    """``loss.backward(); opt.step(); opt.zero_grad()``: the order most examples use."""

    def gradients(self, batch, scale, fire: Fire) -> None:
        x, y, _ = batch
        self.loss(x, y, scale, fire).backward()

    def update(self, fire: Fire) -> None:
        super().update(fire)
        self.opt.zero_grad()


class Schedule(Plain):
    """A warmup: ``LinearLR`` then ``CosineAnnealingLR`` in a ``SequentialLR``, stepped in the
    block."""

    def __init__(self) -> None:
        super().__init__()
        sched = torch.optim.lr_scheduler
        self.scheduler = sched.SequentialLR(self.opt, [
            sched.LinearLR(self.opt, start_factor=0.1, total_iters=4),
            sched.CosineAnnealingLR(self.opt, T_max=12)], milestones=[4])

    def objects(self) -> dict[str, object]:
        return {**super().objects(), "scheduler": self.scheduler}

    def update(self, fire: Fire) -> None:
        super().update(fire)
        self.scheduler.step()

    def compared(self) -> list[torch.Tensor]:
        return super().compared() + [torch.tensor(self.opt.param_groups[0]["lr"])]


class NormDropout(Plain):
    """BatchNorm (running statistics averaged over the ranks before the agreement, so that
    every rank holds the same buffers) and ``nn.Dropout`` drawing from the committed RNG."""

    def __init__(self) -> None:
        self.model = mlp(self.dtype, norm=True, dropout=0.25)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.rng = RNGState()

    def objects(self) -> dict[str, object]:
        return {**super().objects(), "rng": self.rng}

    def wrap(self, s: ElasticState) -> None:
        self.ddp = s.ddp(self.model, broadcast_buffers=False)

    def gradients(self, batch, scale, fire: Fire) -> None:
        super().gradients(batch, scale, fire)
        for buffer in self.model.buffers():
            if buffer.is_floating_point():
                dist.all_reduce(buffer)
                buffer /= dist.get_world_size()


class Gan(Plain):
    """Two models, two optimizers (a GAN-shaped step: a generator through a discriminator);
    the generator's optimizer has two param groups with different LRs."""

    def __init__(self) -> None:
        self.gen = mlp(self.dtype, inputs=4, outputs=8)
        self.model = mlp(self.dtype)  # the discriminator
        self.opt_g = torch.optim.SGD([
            {"params": self.gen[0].parameters(), "lr": 0.05},
            {"params": self.gen[2].parameters(), "lr": 0.01}], momentum=0.9)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)

    def objects(self) -> dict[str, object]:
        return {"generator": self.gen, "model": self.model, "optimizer": self.opt,
                "gen_optimizer": self.opt_g}

    def wrap(self, s: ElasticState) -> None:
        self.gen_ddp = s.ddp(self.gen)
        super().wrap(s)

    def gradients(self, batch, scale, fire: Fire) -> None:
        x, _, idx = batch
        self.opt.zero_grad()
        self.opt_g.zero_grad()
        z = torch.stack([torch.randn(4, dtype=self.dtype, generator=torch.Generator()
                                     .manual_seed(int(i))) for i in idx.tolist()])
        fake = self.gen_ddp(z)
        ((self.ddp(fake).squeeze(-1) - 1) ** 2).sum().mul(scale).backward()
        self.opt.zero_grad()  # the generator's loss reached the discriminator too
        target = torch.cat([torch.ones(len(x), dtype=self.dtype),
                            torch.zeros(len(x), dtype=self.dtype)])
        self.loss(torch.cat([x.to(self.dtype), fake.detach()]), target, scale,
                  fire).backward()

    def update(self, fire: Fire) -> None:
        self.opt.step()
        fire("block")
        self.opt_g.step()


class Ema(Plain):
    """An EMA copy of the weights (``AveragedModel``) registered as state, updated in the
    block."""

    def __init__(self) -> None:
        super().__init__()
        self.ema = AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(0.9))

    def objects(self) -> dict[str, object]:
        return {**super().objects(), "ema": self.ema}

    def update(self, fire: Fire) -> None:
        super().update(fire)
        self.ema.update_parameters(self.model)


class Compiled(Plain):
    """A ``torch.compile``d model (CPU inductor) inside DDP."""

    def wrap(self, s: ElasticState) -> None:
        self.ddp = torch.compile(s.ddp(self.model))


LOOPS: dict[str, type[Plain]] = {
    "amp": Amp, "amp-bf16": AmpBfloat16, "accumulate": Accumulate, "zero-after": ZeroAfter,
    "schedule": Schedule, "norm-dropout": NormDropout, "gan": Gan, "ema": Ema,
    "compiled": Compiled}
