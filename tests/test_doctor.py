"""The precision doctor: the CLI runs, and check() names planted risks."""

import functools
import subprocess
import sys

import torch
from torch import nn

import distamp.doctor


def test_cli_prints_machine_facts_and_advice():
    run = subprocess.run(
        [sys.executable, "-m", "distamp.doctor", "--seconds", "0.05"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    for word in ("torch", "backends", "gloo: yes", "matmul", "float16", "bfloat16", "advice"):
        assert word in run.stdout, word


def test_the_advice_follows_the_fastest_measured_matmul():
    """A half matmul at 70% of FP32's is no reason for mixed precision (an audit: the doctor said
    "O1/O2 pay off" there while benchmarks/compare.py chose FP32); the rule is one for both."""
    slow_half = {"float32": 100.0, "float16": 70.0, "bfloat16": 60.0}
    assert distamp.doctor.fastest_compute(slow_half) == "float32"
    advice = distamp.doctor.cpu_advice(slow_half, bf16_wire=True)
    assert "compute in FP32 (O0)" in advice and "shard_master_weights=True" in advice
    assert "gather_dtype=torch.bfloat16" in advice and "pays off" not in advice
    assert "gather_dtype" not in distamp.doctor.cpu_advice(slow_half, bf16_wire=False)
    units = {"float32": 50.0, "float16": 1.2, "bfloat16": 400.0}
    assert distamp.doctor.fastest_compute(units) == "bfloat16"
    assert "half_dtype=torch.bfloat16" in distamp.doctor.cpu_advice(units, bf16_wire=True)
    fp16_gemm = {"float32": 50.0, "float16": 120.0, "bfloat16": 2.0}
    assert "half_dtype=torch.float16" in distamp.doctor.cpu_advice(fp16_gemm, bf16_wire=True)


def test_check_finds_a_layernorm_eps_that_fp16_rounds_to_0_where_the_norm_may_run_in_fp16():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8, eps=1e-12), nn.Linear(8, 2))
    for level in ("O1", "O3"):
        findings = distamp.doctor.check(model, opt_level=level, half_dtype=torch.float16)
        # (O3 adds one finding for the model: it casts the norms O2 keeps FP32)
        assert [f.module for f in findings] == (["1"] if level == "O1" else ["1", ""])
        assert "eps=1e-12 is too small for torch.float16: it rounds to 0" in findings[0].why
        # torch's kernels compute in FP32; the backward's 1/sqrt(eps) leaves fp16 (an audit)
        assert "1/sqrt(eps) = 1e+06 leaves torch.float16's range" in findings[0].why
        assert "eps >=" in findings[0].fix
    # O2 keeps norms FP32; 1e-5 is an fp16 subnormal, not 0; bf16 has FP32's exponent range.
    assert distamp.doctor.check(model, opt_level="O2", half_dtype=torch.float16) == []
    common = nn.Sequential(nn.LayerNorm(8, eps=1e-5))
    (o3,) = distamp.doctor.check(common, opt_level="O3", half_dtype=torch.float16)
    assert "O3 casts the norm layers O2 keeps FP32 to torch.float16: ['0']" in o3.why
    assert "keep_batchnorm_fp32=True" in o3.fix
    assert distamp.doctor.check(common, "O3", torch.float16, keep_batchnorm_fp32=True) == []
    assert [f.module for f in distamp.doctor.check(model, "O3", torch.bfloat16)] == [""]
    # at O1 on CUDA autocast runs torch's layer_norm in FP32 (an audit: flagged there)
    on_cuda = distamp.doctor.check(model, "O1", torch.float16, device_type="cuda")
    assert [f.module for f in on_cuda if "eps" in f.why] == []


def test_check_names_the_tables_o3_casts():
    """Llama's rotary inv_freq, cast at O3 (O2 keeps it FP32), rotates wrong at long positions
    (an audit: cos off by 1.4 at position 4000 in bf16): named at O3 only."""

    class Rotary(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8))

        def forward(self, x):
            return x

    model = nn.Sequential(nn.Linear(8, 8), Rotary())
    (o3,) = distamp.doctor.check(model, "O3", torch.bfloat16)
    assert "parameter-free modules' buffers O2 keeps FP32 to torch.bfloat16: ['1']" in o3.why
    assert distamp.doctor.check(model, "O2", torch.bfloat16) == []


def test_kept_fp32_lists_the_norms_wrap_recognized_and_changes_nothing():
    class MyLayerNorm(nn.Module):  # nanoGPT's: a weight vector, no bias
        def __init__(self, n):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))

        def forward(self, x):
            return nn.functional.layer_norm(x, self.weight.shape, self.weight, None, 1e-5)

    class Scale(nn.Module):  # not a norm: it has a matrix
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(8, 8))

        def forward(self, x):
            return x @ self.w

    model = nn.Sequential(nn.Linear(8, 8), MyLayerNorm(8), nn.LayerNorm(8), Scale())
    assert distamp.doctor.kept_fp32(model) == ["1", "2"]
    assert distamp.doctor.kept_fp32(model, keep_fp32_modules=["3"]) == ["3", "1", "2"]
    assert distamp.doctor.kept_fp32(model, opt_level="O1") == []  # nothing cast, nothing kept
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_check_flags_softmax_and_losses_in_pure_half():
    model = nn.Sequential(nn.Linear(8, 8), nn.Softmax(dim=-1))
    names = [
        f.module for f in distamp.doctor.check(model, opt_level="O3", half_dtype=torch.bfloat16)
    ]
    assert names == ["1"]
    assert distamp.doctor.check(model, opt_level="O1", half_dtype=torch.bfloat16) == []
    assert distamp.doctor.check(model, opt_level="O2", device_type="cuda", half_dtype=torch.float16)


def test_check_names_a_norm_layer_o2_does_not_recognize():
    """A hand-written LayerNorm whose class name lacks "norm" ran in half under O2 and check said
    nothing, even with an eps that FP16 rounds to 0 (an audit)."""

    class ScaleLN(nn.Module):
        def __init__(self, n, eps=1e-8):
            super().__init__()
            self.weight, self.bias = nn.Parameter(torch.ones(n)), nn.Parameter(torch.zeros(n))
            self.eps = eps

        def forward(self, x):
            mu, var = x.mean(-1, keepdim=True), x.var(-1, keepdim=True, unbiased=False)
            return (x - mu) / torch.sqrt(var + self.eps) * self.weight + self.bias

    model = nn.Sequential(nn.Linear(8, 8), ScaleLN(8), nn.LayerNorm(8), nn.Linear(8, 2))
    findings = distamp.doctor.check(model, opt_level="O2", half_dtype=torch.float16)
    flagged = [f for f in findings if "looks like a normalization layer" in f.why]
    assert [f.module for f in flagged] == ["1"]  # not the LayerNorm O2 keeps FP32
    assert "eps rounds to 0" in flagged[0].why and "keep_fp32_modules=['1']" in flagged[0].fix
    assert not any("looks like" in f.why for f in distamp.doctor.check(model, opt_level="O1"))
    assert "1" in distamp.doctor.kept_fp32(model, keep_fp32_modules=["1"])


def test_check_names_a_layer_calling_an_fft_under_o2_and_o3():
    """FNet's token mixing: torch has no bf16 FFT kernel (nor an fp16 one on CPU), so O2/O3 failed
    at the first forward with torch's bare "Unsupported dtype BFloat16" (an audit); O1's
    autocast runs FFTs in FP32."""

    class FourierMix(nn.Module):
        def forward(self, x):
            return torch.fft.fft2(x).real

    class Spectral(nn.Module):
        def forward(self, x):
            return torch.fft.irfft(torch.fft.rfft(x), n=x.shape[-1])

    class Inherited(Spectral):  # forward from its base
        pass

    class Kept(nn.Module):  # Hugging Face's FNet holds partial(torch.fft.fftn, dim=(1, 2))
        def __init__(self):
            super().__init__()
            self.fourier = functools.partial(torch.fft.fftn, dim=(1, 2))

        def forward(self, x):
            return self.fourier(x).real

    class Cast(nn.Module):
        def forward(self, x):
            # fft2(x) in half fails; a docstring or comment naming torch.fft.fft2(x) is no call
            fft_size = x.shape[-1]
            return torch.fft.fft2(x.float(), s=(fft_size, fft_size)).real  # the advised fix

    class Weird:  # a user's callable whose __getattr__ raises anything (a review: a crash)
        def __call__(self, x):
            return x

        def __getattr__(self, name):
            raise KeyError(name)

    cast = Cast()
    cast.helper = Weird()
    model = nn.Sequential(
        nn.Linear(8, 8), FourierMix(), Spectral(), nn.LayerNorm(8), Inherited(), Kept(), cast
    )
    for level in ("O2", "O3"):
        flagged = [f for f in distamp.doctor.check(model, opt_level=level) if "fft" in f.why]
        assert [f.module for f in flagged] == ["1", "2", "4", "5"], level  # (a review: 4, 5)
        assert "keep_fp32_modules=['1']" in flagged[0].fix
    assert not any("fft" in f.why for f in distamp.doctor.check(model, opt_level="O1"))
    # ... and the fix it names works: the kept layer runs in FP32 under O2.
    wrapped = distamp.wrap(
        model,
        opt_level="O2",
        half_dtype=torch.bfloat16,
        keep_fp32_modules=["1", "2", "4", "5"],
        verbosity=0,
    )
    assert wrapped(torch.randn(2, 4, 8)).dtype == torch.float32


def test_cli_refuses_a_seconds_budget_that_never_ends_or_makes_no_sense():
    """--seconds inf never returned; nan and -1 were taken silently (an audit)."""
    for bad in ("inf", "nan", "-1", "0"):
        run = subprocess.run(
            [sys.executable, "-m", "distamp.doctor", "--seconds", bad],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 2 and "--seconds: expected" in run.stderr, (bad, run.stderr)


def test_compare_matmuls_times_every_dtype_in_interleaved_turns():
    flops = distamp.doctor.compare_matmuls((torch.float32, torch.bfloat16), 0.2, rounds=2)
    assert set(flops) == {"float32", "bfloat16"} and all(v > 0 for v in flops.values())
