"""Real-GPU tests: the CUDA paths against FP32 references, NCCL with one process per GPU.

Each test skips itself by ``torch.cuda.device_count()``; on CPU-only machines they are collected
and skipped. With one GPU: O1/O2/O3 and ``distamp.GradScaler`` on CUDA, NCCL and FSDP at world
size 1, checkpoints written from the GPU (resumed bit for bit, consolidated on the CPU), and two
gloo ranks sharing the GPU (CUDA tensors through gloo) for the global skip. With two or more, the
NCCL tests run one process per GPU.
"""

import os
import sys
import tempfile
import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from models import GradProbe, data, mlp

import distamp
import distamp.fsdp
from distamp.checkpoint import consolidate

GPUS = torch.cuda.device_count()
NCCL_WORLD = min(GPUS, 2)
"""Ranks of the NCCL tests: one process per GPU, at most two; one GPU gives a world of one."""

needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")


def _train(model, opt, batches, device, rank=0, world=1, inject=None):
    """Train on this rank's slice of each batch; return the steps that were skipped."""
    params = list(model.parameters())
    skipped = []
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
        if distamp.stats(opt).last_step_skipped:
            skipped.append(step)
    return skipped


def _reference(batches, skipped, make_opt, device="cuda"):
    """The FP32 model trained on the whole batches, skipping the steps the run skipped."""
    ref = mlp().to(device)
    opt = make_opt(ref.parameters())
    for step, (x, y) in enumerate(batches):
        if step in skipped:
            continue
        F.mse_loss(ref(x.to(device)), y.to(device)).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().float().cpu() for p in ref.parameters()]


def _rel_err(got, ref):
    return max(
        ((g.float().cpu() - r).norm() / r.norm()).item() for g, r in zip(got, ref, strict=True)
    )


@needs_gpu
def test_o2_fp16_on_cuda_tracks_fp32_reference():
    batches = data(50, 32)
    model = mlp().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = distamp.wrap(model, opt, opt_level="O2")
    assert model[0].weight.dtype == torch.float16  # "auto" is fp16 on CUDA
    assert model[1].weight.dtype == torch.float32  # LayerNorm kept FP32
    skipped = _train(model, opt, batches, "cuda")
    assert len(skipped) <= 2  # the first steps may overflow at 2**16 and back off
    ref = _reference(batches, skipped, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
    assert _rel_err(model.parameters(), ref) < 2e-2  # fp16 weights rounded 50 times (2**-11 each)


@needs_gpu
@pytest.mark.parametrize(
    "opt_level,half,tol",
    [("O1", torch.float16, 1e-2), ("O1", torch.bfloat16, 3e-2), ("O2", torch.bfloat16, 3e-2)],
)
def test_opt_levels_on_cuda_track_fp32_reference(opt_level, half, tol):
    batches = data(40, 32)
    model = mlp().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = distamp.wrap(model, opt, opt_level=opt_level, half_dtype=half, verbosity=0)
    seen = []
    model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    skipped = _train(model, opt, batches, "cuda")
    assert set(seen) == {half}  # the first Linear ran in the half dtype at every step
    assert len(skipped) <= 2
    ref = _reference(batches, skipped, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    assert _rel_err(model.parameters(), ref) < tol


@needs_gpu
def test_o1_autocast_reaches_a_forward_run_in_another_thread():
    model = distamp.wrap(mlp().cuda(), opt_level="O1", verbosity=0)
    dtypes = []
    model[0].register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    out = []
    worker = threading.Thread(target=lambda: out.append(model(torch.randn(4, 8, device="cuda"))))
    worker.start()
    worker.join()
    assert dtypes == [torch.float16]  # autocast was entered inside forward, in that thread
    assert out[0].shape == (4, 4)


@needs_gpu
def test_o3_fp16_on_cuda_trains():
    batches = data(40, 32)
    model = mlp().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = distamp.wrap(model, opt, opt_level="O3", verbosity=0)
    assert all(p.dtype == torch.float16 for p in model.parameters())
    x, y = batches[0]
    first = F.mse_loss(model(x.cuda()).float(), y.cuda()).item()
    _train(model, opt, batches, "cuda")
    last = F.mse_loss(model(x.cuda()).float(), y.cuda()).item()
    assert last < 0.5 * first


@needs_gpu
def test_grad_scaler_on_cuda_matches_torch_grad_scaler():
    """distamp.GradScaler with torch.autocast on CUDA: the same scales and (within FP32 rounding)
    the same weights as torch.amp.GradScaler, an injected inf included."""
    results = []
    for scaler_cls in (torch.amp.GradScaler, distamp.GradScaler):
        model = mlp().cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = scaler_cls("cuda", init_scale=2.0**10, growth_interval=5)
        scales = []
        for step, (x, y) in enumerate(data(20, 16)):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.mse_loss(model(x.cuda()).float(), y.cuda())
            scaler.scale(loss).backward()
            if step == 7:
                model[0].weight.grad.view(-1)[0] = float("inf")
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
        results.append(([p.detach().cpu() for p in model.parameters()], scales))
    (torch_params, torch_scales), (ours, our_scales) = results
    assert our_scales == torch_scales
    assert our_scales[7] == our_scales[6] / 2  # the injected inf backed off
    for a, b in zip(ours, torch_params, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _init(backend, rank, world, init_file):
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        torch.cuda.set_device(0)  # gloo ranks share the one GPU
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    return torch.device("cuda", torch.cuda.current_device())


def _finish():
    dist.barrier()  # gloo aborts a rank that tears down while a peer still runs
    dist.destroy_process_group()


def _ddp_worker(rank, world, init_file, out, backend, shard, hook, opt_level="O2", register=None):
    device = _init(backend, rank, world, init_file)
    model = mlp().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = distamp.wrap(
        model, opt, opt_level=opt_level, shard_master_weights=shard, verbosity=0
    )
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    state = None
    if hook:
        register = register or {"reduce_scatter": shard and world > 1}
        state = distamp.hooks.register(ddp, opt, **register)
    skipped = _train(ddp, opt, data(20, 8 * world), device, rank, world, inject=(5, world - 1))
    if state is not None and register.get("overlap_gather"):
        state.finish_gather()  # the last step's weights, gathered before they are read
    torch.save(
        {
            "params": [p.detach().float().cpu() for p in model.parameters()],
            "skipped": skipped,
            "scale": distamp.stats(opt).loss_scales[0],
        },
        os.path.join(out, f"{rank}.pt"),
    )
    _finish()


def _check_ranks_agree_and_track_reference(results, world):
    for r in results[1:]:
        assert r["skipped"] == results[0]["skipped"]
        assert r["scale"] == results[0]["scale"]
        for a, b in zip(r["params"], results[0]["params"], strict=True):
            assert torch.equal(a, b)
    assert 5 in results[0]["skipped"]  # the inf injected on the last rank only
    ref = _reference(
        data(20, 8 * world), results[0]["skipped"], lambda ps: torch.optim.Adam(ps, lr=1e-3)
    )
    assert _rel_err(results[0]["params"], ref) < 1e-2


def _spawn(worker, world, *args):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(world, os.path.join(tmp, "rdzv"), tmp, *args), nprocs=world)
        return [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(world)]


@needs_gpu
@pytest.mark.parametrize("hook", [False, True], ids=["ddp-allreduce", "distamp-hook"])
def test_nccl_one_process_per_gpu_skips_together(hook):
    results = _spawn(_ddp_worker, NCCL_WORLD, "nccl", True, hook)
    _check_ranks_agree_and_track_reference(results, NCCL_WORLD)


@needs_gpu
@pytest.mark.parametrize(
    "shard,hook",
    [(False, False), (False, True), (True, False), (True, True)],
    ids=["replicated", "replicated-hook", "sharded", "sharded-reduce-scatter"],
)
def test_two_gloo_ranks_sharing_one_gpu_skip_together(shard, hook):
    """CUDA tensors through gloo (two ranks, one GPU): the skip decision, the sharded masters'
    gathers and the hooks on device tensors, with an inf on rank 1 only."""
    results = _spawn(_ddp_worker, 2, "gloo", shard, hook)
    _check_ranks_agree_and_track_reference(results, 2)


@needs_gpu
@pytest.mark.parametrize(
    "opt_level,register",
    [
        ("O0", {"reduce_scatter": True, "overlap_gather": True}),
        ("O1", {"reduce_scatter": True, "gather_dtype": torch.bfloat16}),
        ("O2", {"reduce_scatter": True, "overlap_gather": True}),
    ],
    ids=["O0-zero1-overlapped", "O1-zero1-bf16-updates", "O2-overlapped"],
)
def test_sharded_fp32_weights_on_one_gpu_skip_together(opt_level, register):
    """ZeRO-1 of FP32 weights (O0/O1 with ``shard_master_weights=True``) and the overlapped
    gather, with CUDA tensors through gloo: two ranks, one GPU, an inf on rank 1 only."""
    results = _spawn(_ddp_worker, 2, "gloo", True, True, opt_level, register)
    _check_ranks_agree_and_track_reference(results, 2)


def _nccl_hooks_worker(rank, world, init_file, out):
    _init("nccl", rank, world, init_file)
    results = {}
    for name, hook in (
        ("fp16", distamp.hooks.fp16_compress_hook),
        ("bf16", distamp.hooks.bf16_compress_hook),
    ):
        model = torch.nn.parallel.DistributedDataParallel(GradProbe(4).cuda(), device_ids=[rank])
        model.register_comm_hook(None, hook)
        g = torch.tensor([5e4, 1e-6, 1.0, 0.0], device="cuda")
        if rank == 0:
            g[2] = 6e4 * world  # the sum overflows FP16 at 2 ranks; the mean does not
        model(g).backward()
        results[name] = model.module.w.grad.cpu()
    torch.save(results, os.path.join(out, f"{rank}.pt"))
    _finish()


@needs_gpu
def test_hooks_on_nccl_are_overflow_safe():
    result = _spawn(_nccl_hooks_worker, NCCL_WORLD)[0]
    for grad in result.values():
        assert torch.isfinite(grad).all()
        assert abs(grad[0].item() - 5e4) / 5e4 < 1e-2
        assert grad[1].item() > 0


def _fsdp_worker(rank, world, init_file, out, api):
    device = _init("nccl", rank, world, init_file)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = distamp.fsdp.fully_shard(
        model, opt, opt_level="O2", api=api, blocks=[torch.nn.Linear], verbosity=0
    )
    batches = data(20, 8)
    x, y = batches[0]
    first = F.mse_loss(model(x.to(device)).float(), y.to(device)).item()
    skipped = _train(model, opt, batches, device, rank, world, inject=(5, world - 1))
    last = F.mse_loss(model(x.to(device)).float(), y.to(device)).item()
    stats = distamp.stats(opt)
    torch.save(
        {"skipped": skipped, "scale": stats.loss_scales[0], "first": first, "last": last},
        os.path.join(out, f"{rank}.pt"),
    )
    _finish()


@needs_gpu
@pytest.mark.parametrize("api", ["fsdp2", "fsdp1"])
def test_fsdp_on_nccl_skips_together(api):
    results = _spawn(_fsdp_worker, NCCL_WORLD, api)
    for r in results[1:]:
        assert (r["skipped"], r["scale"]) == (results[0]["skipped"], results[0]["scale"])
    assert 5 in results[0]["skipped"]  # the injected inf, on one rank only
    assert results[0]["last"] < results[0]["first"]


def _checkpoint_worker(rank, world, init_file, out):
    device = _init("nccl", rank, world, init_file)

    def make():
        model = mlp().to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
        return model, ddp, opt

    batches = data(16, 8 * world)
    model, ddp, opt = make()
    _train(ddp, opt, batches[:8], device, rank, world)
    distamp.save_checkpoint(os.path.join(out, "ckpt"), model, opt, extra={"step": 8})
    at_save = [p.detach().float().cpu().clone() for p in model.parameters()]
    _train(ddp, opt, batches[8:], device, rank, world)
    straight = [p.detach().cpu() for p in model.parameters()]
    model2, ddp2, opt2 = make()
    extra = distamp.load_checkpoint(os.path.join(out, "ckpt"), model2, opt2)
    _train(ddp2, opt2, batches[8:], device, rank, world)
    resumed = [p.detach().cpu() for p in model2.parameters()]
    torch.save(
        {"straight": straight, "resumed": resumed, "extra": extra, "at_save": at_save},
        os.path.join(out, f"{rank}.pt"),
    )
    _finish()


@needs_gpu
def test_checkpoint_from_gpu_resumes_bit_exact_and_consolidates_on_cpu():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            _checkpoint_worker, args=(NCCL_WORLD, os.path.join(tmp, "rdzv"), tmp), nprocs=NCCL_WORLD
        )
        result = torch.load(os.path.join(tmp, "0.pt"))
        fp32 = consolidate(os.path.join(tmp, "ckpt"))  # no ranks, no GPU needed
    assert result["extra"]["step"] == 8
    for a, b in zip(result["resumed"], result["straight"], strict=True):
        assert torch.equal(a, b)
    plain = mlp()  # an unwrapped FP32 model on the CPU loads the masters
    plain.load_state_dict(fp32)
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in fp32.values())
    for master, half in zip(plain.parameters(), result["at_save"], strict=True):
        torch.testing.assert_close(master.detach(), half, rtol=1e-3, atol=1e-3)  # fp16 rounding
