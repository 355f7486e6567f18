"""The precision doctor: the CLI runs, and check() names planted risks."""

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


def test_check_finds_a_tiny_layernorm_eps_under_fp16_and_names_it():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8, eps=1e-12), nn.Linear(8, 2))
    findings = distamp.doctor.check(model, opt_level="O2", half_dtype=torch.float16)
    assert [f.module for f in findings] == ["1"]
    assert "eps=1e-12" in findings[0].why and "float16" in findings[0].why
    assert "eps >=" in findings[0].fix
    # bf16 has FP32's exponent range: 1e-12 is representable there.
    assert distamp.doctor.check(model, opt_level="O2", half_dtype=torch.bfloat16) == []


def test_check_flags_softmax_and_losses_in_pure_half():
    model = nn.Sequential(nn.Linear(8, 8), nn.Softmax(dim=-1))
    names = [
        f.module for f in distamp.doctor.check(model, opt_level="O3", half_dtype=torch.bfloat16)
    ]
    assert names == ["1"]
    assert distamp.doctor.check(model, opt_level="O1", half_dtype=torch.bfloat16) == []
    assert distamp.doctor.check(model, opt_level="O2", device_type="cuda", half_dtype=torch.float16)
