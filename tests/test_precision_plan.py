"""One precision decision per tensor under O2: tied weights, norm classes that are not torch's,
buffers such as RoPE's inv_freq, FP32 modules fed integers (see [Note: one precision decision
per tensor] in distamp/casting.py)."""

import copy
import io
import warnings

import pytest
import torch
from models import NormMLP
from torch import nn
from user_models import GPTConfig, LlamaConfig, NanoGPT, TinyLlama

import distamp


def _wrap(model, level="O2", **kw):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = distamp.wrap(model, opt, opt_level=level, verbosity=0, **kw)
    return model, opt, [str(w.message) for w in caught]


def _stepped_dtypes(model, opt):
    """For each parameter: the dtype of the tensor the optimizer steps for it."""
    masters = opt._distamp.masters
    return {
        name: (m.dtype if sep else p.dtype)
        for name, p in model.named_parameters(remove_duplicate=False)
        for q, m, sep in zip(*masters.columns(), strict=True)
        if q is p
    }


# -- tied weights ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kept", ["transformer.wte", "lm_head"])
def test_a_tied_weight_gets_one_decision_when_one_of_its_modules_stays_fp32(kept):
    torch.manual_seed(0)
    model = NanoGPT(GPTConfig())
    model, opt, messages = _wrap(model, keep_fp32_modules=[kept])
    tied = model.lm_head.weight
    assert tied is model.transformer.wte.weight and tied.dtype == torch.float32
    assert _stepped_dtypes(model, opt)["lm_head.weight"] == torch.float32
    other = "lm_head" if kept == "transformer.wte" else "transformer.wte"
    assert any(f"so {other!r} runs in FP32 too" in m for m in messages), messages
    idx = torch.randint(0, 61, (2, 8))
    logits, loss = model(idx, idx)  # no dtype clash between an FP32 weight and half inputs
    assert logits.dtype == torch.float32 and torch.isfinite(loss)
    with distamp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    before = tied.detach().clone()
    opt.step()
    assert not torch.equal(tied, before)


class SharedWithABlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.block = nn.Sequential(nn.Linear(4, 4))
        self.block.register_parameter("shared", self.emb.weight)  # a block owning it directly


def test_a_weight_shared_with_a_module_holding_half_submodules_is_refused_by_name():
    with pytest.raises(ValueError, match=r"'emb.weight' is shared by 'emb'.*'block'.*untie"):
        _wrap(SharedWithABlock(), keep_fp32_modules=["emb"])


# -- normalization layers that are not torch's ---------------------------------------------------


def test_norm_classes_written_by_users_stay_fp32_under_o2():
    torch.manual_seed(0)
    gpt, _, _ = _wrap(NanoGPT(GPTConfig(bias=True)))
    llama, _, _ = _wrap(TinyLlama(LlamaConfig()))
    for name, p in [*gpt.named_parameters(), *llama.named_parameters()]:
        is_norm = "ln_" in name or "norm" in name
        assert p.dtype == (torch.float32 if is_norm else torch.bfloat16), name


class NormalizedLinear(nn.Module):  # "Norm" in the name, but it holds a matrix
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return x @ (self.weight / self.weight.norm(dim=0))


class AdaLayerNorm(nn.Module):  # a norm with a projection inside: its Linear is a half layer
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 8)


def test_norm_recognition_by_name_and_shape():
    from distamp.casting import is_norm

    assert is_norm(nn.LayerNorm(4)) and is_norm(nn.BatchNorm1d(4))
    assert is_norm(TinyLlama(LlamaConfig()).norm)
    assert not is_norm(NormalizedLinear())
    assert not is_norm(AdaLayerNorm())
    assert not is_norm(nn.Linear(4, 4))

    class ChanRMSNorm(nn.Module):  # lucidrains' diffusion models: a gain shaped to broadcast
        def __init__(self):
            super().__init__()
            self.g = nn.Parameter(torch.ones(1, 8, 1, 1))

    assert is_norm(ChanRMSNorm())


# -- buffers ---------------------------------------------------------------------------------------


def _angles(cos, sin):
    return torch.atan2(sin.float(), cos.float())


def test_rotary_inv_freq_stays_fp32_and_the_rotation_is_right_at_distance_1024():
    torch.manual_seed(0)
    ref = TinyLlama(LlamaConfig(hidden_size=64, num_attention_heads=1))
    model, _, _ = _wrap(copy.deepcopy(ref))
    assert model.rotary_emb.inv_freq.dtype == torch.float32
    pos = torch.arange(1024).unsqueeze(0)
    x = torch.zeros(1, 1024, 64)
    cos, sin = model.rotary_emb(x.bfloat16(), pos)
    assert cos.dtype == sin.dtype == torch.bfloat16  # returned in the dtype of its input
    ref_cos, ref_sin = ref.rotary_emb(x, pos)
    err = (_angles(cos, sin) - _angles(ref_cos, ref_sin)).remainder(2 * torch.pi)
    err = torch.minimum(err, 2 * torch.pi - err)
    # Stated tolerance: cos/sin rounded once to BF16 (relative 2**-9) -> below 0.01 rad. A BF16
    # inv_freq is off by up to 2**-9 relative, i.e. ~0.18 rad at position 1023 for the fastest
    # frequency; the FP32 table is exact.
    assert err.max() < 0.01
    bf16_table = ref.rotary_emb.inv_freq.bfloat16().float()
    assert (bf16_table[None, :] * 1023 - ref.rotary_emb.inv_freq * 1023).abs().max() > 0.05


def test_batchnorm_statistics_stay_fp32_and_o3_casts_everything():
    o2, _, _ = _wrap(NormMLP())
    assert o2.bn.running_mean.dtype == o2.bn.running_var.dtype == torch.float32
    o3, _, _ = _wrap(NormMLP(), level="O3")
    assert o3.bn.running_mean.dtype == torch.bfloat16


class RopeInsideAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("mask", torch.tensor([0.0, -100.0]), persistent=False)


def test_a_buffer_that_loses_precision_with_its_module_is_named_in_a_warning():
    model, _, messages = _wrap(RopeInsideAttention())
    assert model.inv_freq.dtype == torch.bfloat16  # cast with its module's parameters (apex)
    assert any("['inv_freq'] lost precision" in m for m in messages), messages
    assert not any("'mask'" in m for m in messages)  # exact in BF16: nothing lost, no warning


# -- FP32 modules fed integers --------------------------------------------------------------------


def test_an_fp32_embedding_returns_the_half_dtype_to_the_layers_after_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2))
    model, opt, _ = _wrap(model, keep_fp32_modules=["0"])
    assert model[0].weight.dtype == torch.float32 and model[1].weight.dtype == torch.bfloat16
    assert model[0](torch.tensor([1, 2])).dtype == torch.bfloat16
    out = model(torch.tensor([[1, 2, 3]]))  # used to fail: FP32 input to a BF16 Linear
    assert out.dtype == torch.float32


def test_o2_models_written_by_users_train_close_to_fp32():
    """Stated tolerance: after 5 AdamW steps the O2 loss is within 2% of the FP32 loss."""
    results = {}
    for level in ("fp32", "O2"):
        torch.manual_seed(0)
        model = TinyLlama(LlamaConfig())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if level == "O2":
            model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
        gen = torch.Generator().manual_seed(1)
        for _ in range(5):
            ids = torch.randint(0, 53, (4, 12), generator=gen)
            loss = model(ids, ids)["loss"]
            if level == "O2":
                with distamp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            else:
                loss.backward()
            opt.step()
            opt.zero_grad()
        results[level] = loss.item()
    assert results["O2"] == pytest.approx(results["fp32"], rel=0.02)


# -- torch modules whose fused inference path reads their norms --------------------------------


class EncoderClassifier(nn.Module):
    """A stock ``nn.TransformerEncoder`` (BERT-style: padding mask, final norm) and a head."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(16))
        self.head = nn.Linear(16, 3)

    def forward(self, x, pad=None):
        return self.head(self.encoder(x, src_key_padding_mask=pad)[:, 0])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")  # torch's own
def test_a_stock_transformer_encoder_evaluates_with_a_padding_mask_under_o2():
    """In eval under no_grad, nn.TransformerEncoder with a padding mask runs its layers through
    one fused kernel on nested tensors, norms included: they take the layer's dtype (used to
    raise "expected scalar type Float but found BFloat16"). The final norm, outside that kernel,
    stays FP32. Stated tolerance: the fused result equals the layer-by-layer one (grad enabled)
    within bf16's rounding, 3e-2, on the rows the mask keeps."""
    torch.manual_seed(0)
    model, opt, _ = _wrap(EncoderClassifier())
    layer = model.encoder.layers[0]
    assert layer.norm1.weight.dtype == layer.linear1.weight.dtype == torch.bfloat16
    assert model.encoder.norm.weight.dtype == torch.float32
    x = torch.randn(2, 5, 16)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    model.eval()
    with torch.no_grad():
        fused = model(x, pad)
    layered = model(x, pad).detach()  # grad enabled: no fast path
    assert fused.dtype == torch.float32 and torch.isfinite(fused).all()
    torch.testing.assert_close(fused, layered, atol=3e-2, rtol=3e-2)
    model.train()  # and it still trains: the loss goes down
    target = torch.tensor([0, 2])
    losses = []
    for _ in range(5):
        loss = nn.functional.cross_entropy(model(x, pad), target)
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_tied_weight_is_one_fp32_tensor_in_the_state_dict_as_in_torchs(level):
    """nanoGPT ties ``lm_head`` to ``wte``: torch's state dict holds one tensor under both keys,
    which ``torch.save`` writes once. The O2 state dict widened each alias into its own FP32
    copy (an audit: T5's four aliases written four times). One copy per call, both keys."""
    torch.manual_seed(0)
    plain = NanoGPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16))
    ref = plain.state_dict()
    assert ref["transformer.wte.weight"].data_ptr() == ref["lm_head.weight"].data_ptr()
    model, _, _ = _wrap(copy.deepcopy(plain), level)
    state = model.state_dict()
    tied = state["transformer.wte.weight"]
    assert tied.dtype == torch.float32 and state["lm_head.weight"] is tied
    saved, one_copy = io.BytesIO(), io.BytesIO()
    torch.save(state, saved)
    torch.save({"transformer.wte.weight": tied}, one_copy)
    untied = {k: v for k, v in state.items() if k != "lm_head.weight"}
    untied_bytes = io.BytesIO()
    torch.save(untied, untied_bytes)
    assert saved.tell() - untied_bytes.tell() < one_copy.tell() // 2  # no second copy written
    plain.load_state_dict(state)  # a plain FP32 model loads it
    assert torch.equal(plain.lm_head.weight, tied)
    # a later call widens the weights as they are then, not the first call's copies
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    again = model.state_dict()
    assert again["lm_head.weight"] is again["transformer.wte.weight"]
    assert torch.equal(again["lm_head.weight"], model.lm_head.weight.float())
    assert not torch.equal(again["lm_head.weight"], tied)
    # ... also passed again from a submodule, from the other holder of the tied weight, or
    # under another prefix (reviews: stale)
    for call in (
        lambda: model.lm_head.state_dict(destination=again, prefix="lm_head."),
        lambda: model.transformer.wte.state_dict(destination=again, prefix="lm_head."),
        lambda: model.state_dict(destination=again, prefix="snap."),
    ):
        with torch.no_grad():
            model.lm_head.weight.add_(1.0)
        call()
        live = model.lm_head.weight.float()
        assert torch.equal(again["lm_head.weight"], live)
    assert torch.equal(again["snap.lm_head.weight"], live)
    assert again["snap.lm_head.weight"] is again["snap.transformer.wte.weight"]
    # a plain dict destination (no weak reference) still widens each alias correctly
    into: dict = {}
    model.state_dict(destination=into)
    assert torch.equal(into["lm_head.weight"], into["transformer.wte.weight"])
    assert into["lm_head.weight"].dtype == torch.float32
    # two threads' calls at once each keep the tie (a review: they reset each other's copies)
    import sys
    import threading

    untied = []

    def snapshots():
        for _ in range(50):
            state = model.state_dict()
            untied.append(state["lm_head.weight"] is not state["transformer.wte.weight"])

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=snapshots) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert len(untied) == 100 and not any(untied)
