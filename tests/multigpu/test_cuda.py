"""Real-GPU tests: O2 FP16 on CUDA against an FP32 reference, and NCCL with one process per GPU.

Each test skips itself by ``torch.cuda.device_count()``; on CPU-only machines they are collected
and skipped.
"""

import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from models import GradProbe, data, mlp

import distamp

GPUS = torch.cuda.device_count()


def _train(model, opt, batches, device, rank=0, world=1, inject=None):
    params = list(model.parameters())
    for step, (x, y) in enumerate(batches):
        n = x.shape[0] // world
        x, y = x[rank * n : (rank + 1) * n].to(device), y[rank * n : (rank + 1) * n].to(device)
        loss = F.mse_loss(model(x).float(), y)
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        if inject is not None and step == inject[0] and rank == inject[1]:
            # The first gradient this rank holds a piece of (FSDP: its local shard).
            for p in params:
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                if g is not None and g.numel() > 0:
                    g.view(-1)[0] = float("inf")
                    break
        opt.step()
        opt.zero_grad()


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
def test_o2_fp16_on_cuda_tracks_fp32_reference():
    batches = data(50, 32)
    ref = mlp().cuda()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for x, y in batches:
        F.mse_loss(ref(x.cuda()), y.cuda()).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    model = mlp().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = distamp.wrap(model, opt, opt_level="O2")
    assert model[0].weight.dtype == torch.float16  # "auto" is fp16 on CUDA
    _train(model, opt, batches, "cuda")
    assert distamp.stats(opt).skipped_steps <= 2
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        assert ((p.float() - r).norm() / r.norm()).item() < 1e-2


def _nccl_worker(rank, world, init_file, out):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    model = mlp().cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    _train(ddp, opt, data(20, 8 * world), "cuda", rank, world, inject=(5, world - 1))
    torch.save(
        {"params": [p.detach().cpu() for p in model.parameters()], "stats": distamp.stats(opt)},
        os.path.join(out, f"{rank}.pt"),
    )
    dist.barrier()  # gloo aborts a rank that tears down while a peer still runs
    dist.destroy_process_group()


@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")
def test_nccl_one_process_per_gpu_skips_together():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_nccl_worker, args=(GPUS, os.path.join(tmp, "rdzv"), tmp), nprocs=GPUS)
        results = [
            torch.load(os.path.join(tmp, f"{r}.pt"), weights_only=False) for r in range(GPUS)
        ]
    for r in results[1:]:
        assert r["stats"].skipped_steps == results[0]["stats"].skipped_steps == 1
        for a, b in zip(r["params"], results[0]["params"], strict=True):
            assert torch.equal(a, b)


def _nccl_hooks_worker(rank, world, init_file, out):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    for name, hook in (
        ("fp16", distamp.hooks.fp16_compress_hook),
        ("bf16", distamp.hooks.bf16_compress_hook),
    ):
        model = torch.nn.parallel.DistributedDataParallel(GradProbe(4).cuda(), device_ids=[rank])
        model.register_comm_hook(None, hook)
        g = torch.tensor([5e4, 1e-6, 1.0, 0.0], device="cuda")
        if rank == 0:
            g[2] = 1e5
        model(g).backward()
        results[name] = model.module.w.grad.cpu()
    torch.save(results, os.path.join(out, f"{rank}.pt"))
    dist.barrier()  # gloo aborts a rank that tears down while a peer still runs
    dist.destroy_process_group()


@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")
def test_hooks_on_nccl_are_overflow_safe():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_nccl_hooks_worker, args=(GPUS, os.path.join(tmp, "rdzv"), tmp), nprocs=GPUS)
        result = torch.load(os.path.join(tmp, "0.pt"))
    for grad in result.values():
        assert torch.isfinite(grad).all()
        assert abs(grad[0].item() - 5e4) / 5e4 < 1e-3
        assert grad[1].item() > 0


def _fsdp_worker(rank, world, init_file, api, out):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import distamp.fsdp

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = distamp.fsdp.fully_shard(
        model, opt, opt_level="O2", api=api, blocks=[torch.nn.Linear], verbosity=0
    )
    _train(model, opt, data(20, 8), f"cuda:{rank}", rank, world, inject=(5, world - 1))
    stats = distamp.stats(opt)
    torch.save({"skipped": stats.skipped_steps, "scale": stats.loss_scales[0]}, f"{out}{rank}.pt")
    dist.barrier()  # gloo aborts a rank that tears down while a peer still runs
    dist.destroy_process_group()


@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("api", ["fsdp2", "fsdp1"])
def test_fsdp_on_nccl_skips_together(api):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r")
        mp.spawn(_fsdp_worker, args=(2, os.path.join(tmp, "init"), api, out), nprocs=2)
        results = [torch.load(f"{out}{r}.pt") for r in range(2)]
    assert results[0] == results[1]
    assert results[0]["skipped"] >= 1  # the injected inf, on one rank only
