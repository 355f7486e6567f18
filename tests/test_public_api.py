"""``import distamp`` is enough: every name the README writes as ``distamp.<x>`` resolves, in a
fresh interpreter (nothing imported by an earlier test can hide a missing import)."""

import subprocess
import sys

import distamp

README_NAMES = [
    "amp.initialize",
    "checkpoint",
    "clip_grad_norm_",
    "debug.find_nonfinite",
    "doctor.check",
    "doctor.machine",
    "fsdp.fully_shard",
    "GradScaler",
    "hooks.bf16_compress_hook",
    "hooks.fp16_compress_hook",
    "hooks.register",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "scale_loss",
    "stats",
    "unscale_",
    "wrap",
]


def test_readme_names_resolve_after_a_plain_import():
    code = "import distamp\n" + "".join(f"distamp.{name}\n" for name in README_NAMES)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_all_is_sorted_and_complete():
    assert distamp.__all__ == sorted(distamp.__all__)
    assert len(set(distamp.__all__)) == len(distamp.__all__)
    for name in distamp.__all__:
        assert hasattr(distamp, name), name
