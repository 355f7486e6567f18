"""What wrap does to a model at each opt_level: dtypes, forward casts, autocast in any thread."""

import abc
import copy
import math
import threading
import typing
import warnings
from collections.abc import MutableMapping

import pytest
import torch
from models import NormMLP
from torch import nn

import distamp
from distamp.casting import cast_floating

LEVELS = ["O0", "O1", "O2", "O3"]
HALVES = [torch.float16, torch.bfloat16]


def wrapped(level, half, **kw):
    torch.manual_seed(0)
    model = NormMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return distamp.wrap(model, opt, opt_level=level, half_dtype=half, **kw)


def matmul_dtypes(model, x):
    """The dtypes the model's Linear layers actually computed in."""
    seen = []
    handles = [
        m.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
        for m in model.modules()
        if isinstance(m, nn.Linear)
    ]
    try:
        model(x)
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("level", LEVELS)
def test_parameter_and_buffer_dtypes(level, half):
    model, _ = wrapped(level, half)
    weight = model.fc1.weight.dtype
    norm = {model.bn.weight.dtype, model.bn.running_mean.dtype, model.ln.weight.dtype}
    expected_weight = half if level in ("O2", "O3") else torch.float32
    expected_norm = half if level == "O3" else torch.float32
    assert weight == expected_weight
    assert norm == {expected_norm}
    assert model.bn.num_batches_tracked.dtype == torch.int64  # integer buffers are never cast


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("level", LEVELS)
def test_output_and_compute_dtypes(level, half):
    model, _ = wrapped(level, half)
    x = torch.randn(4, 8)
    out = model(x)
    computed = set(matmul_dtypes(model, x))
    if level == "O0":
        assert (out.dtype, computed) == (torch.float32, {torch.float32})
    elif level == "O1":
        # autocast: matmuls in half, weights FP32, output as autocast left it (apex O1)
        assert (out.dtype, computed) == (half, {half})
    else:
        # cast model: matmuls in half, output cast back to FP32 ("never call .half() yourself")
        assert (out.dtype, computed) == (torch.float32, {half})


@pytest.mark.parametrize("half", HALVES)
def test_cast_model_outputs_overrides_output_dtype(half):
    model, _ = wrapped("O2", half, cast_model_outputs=half)
    assert model(torch.randn(3, 8)).dtype == half
    model, _ = wrapped("O1", half, cast_model_outputs=torch.float32)
    assert model(torch.randn(3, 8)).dtype == torch.float32


def test_norm_layers_under_o2_compute_in_fp32_and_hand_back_half():
    model, _ = wrapped("O2", torch.bfloat16)
    x = torch.randn(4, 16).to(torch.bfloat16)
    out = model.ln(x)
    expected = nn.functional.layer_norm(
        x.float(), (16,), model.ln.weight, model.ln.bias, model.ln.eps
    ).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected)
    # computing the norm in bf16 would round differently
    in_half = nn.functional.layer_norm(
        x, (16,), model.ln.weight.bfloat16(), model.ln.bias.bfloat16(), model.ln.eps
    )
    assert out.dtype == in_half.dtype


def test_fp32_norm_gradients_match_a_float64_reference():
    """The FP32 norm's weight and bias gradients, from half activations, are FP32-accurate (torch's
    mixed-dtype CPU layer_norm, a bf16 input with FP32 weights, was off by up to 7%)."""
    torch.manual_seed(0)
    norm = nn.LayerNorm(512)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(512))
        norm.bias.add_(0.1 * torch.randn(512))
    model, _ = distamp.wrap(
        nn.Sequential(norm), torch.optim.SGD(norm.parameters(), lr=0.1), opt_level="O2",
        half_dtype=torch.bfloat16, verbosity=0,
    )  # fmt: skip
    x = torch.randn(8, 128, 512).to(torch.bfloat16)
    upstream = torch.randn(8, 128, 512).to(torch.bfloat16)
    model[0](x).backward(upstream)
    ref = nn.LayerNorm(512).double()
    with torch.no_grad():
        ref.weight.copy_(model[0].weight)
        ref.bias.copy_(model[0].bias)
    ref(x.double()).backward(upstream.double())
    for name in ("weight", "bias"):
        got, want = getattr(model[0], name).grad, getattr(ref, name).grad
        assert got.dtype == torch.float32
        # measured 6e-5 against values up to 86 (the mixed-dtype kernel: 6.0)
        torch.testing.assert_close(got.double(), want, atol=1e-3, rtol=1e-5, msg=name)


@pytest.mark.parametrize("half", HALVES)
def test_o1_autocast_applies_in_a_new_thread_without_any_context(half):
    model, _ = wrapped("O1", half)
    x = torch.randn(4, 8)
    result = {}

    def run():
        assert not torch.is_autocast_enabled("cpu")
        result["dtypes"] = matmul_dtypes(model, x)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert result["dtypes"] and set(result["dtypes"]) == {half}


def test_autocast_lives_in_the_class_not_on_the_instance():
    model, _ = wrapped("O1", torch.bfloat16)
    assert "forward" not in vars(model)
    assert isinstance(model, NormMLP)
    assert type(model).__name__ == "NormMLP"
    # DataParallel's replicate copies __dict__ into a new instance of type(model)
    replica = model._replicate_for_data_parallel()
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(d=matmul_dtypes(replica, torch.randn(2, 8)))
    )
    thread.start()
    thread.join()
    assert set(result["d"]) == {torch.bfloat16}
    clone = copy.deepcopy(model)
    assert set(matmul_dtypes(clone, torch.randn(2, 8))) == {torch.bfloat16}


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_wrapped_model_pickles_and_its_copy_keeps_the_forward(level):
    """torch.save(model) and handing the model to a spawned process pickle it; the generated
    class used to pickle as the user's class and failed ("not the same object as ...")."""
    import io
    import pickle

    model, opt = wrapped(level, torch.bfloat16)
    x = torch.randn(2, 8)
    for copied in (
        pickle.loads(pickle.dumps(model)),
        _saved_and_loaded(model, io.BytesIO()),
        copy.deepcopy(model),
    ):
        assert isinstance(copied, NormMLP) and type(copied).__name__ == "NormMLP"
        assert set(matmul_dtypes(copied, x)) == {torch.bfloat16}
        assert torch.equal(copied(x), model(x))
        if level == "O2":  # the norm layers keep their FP32 forward; the copy owns no masters
            assert (
                copied.ln.weight.dtype == torch.float32 and copied.bn.weight.dtype == torch.float32
            )
            # [Note: a copy's state dict is live]: an EMA written through it moves (timm's)
            state = copied.state_dict()
            assert state["fc1.weight"].dtype == torch.bfloat16
            state["fc1.weight"].mul_(0.5)
            assert torch.equal(copied.fc1.weight, model.fc1.weight * 0.5)
            plain = NormMLP()
            plain.load_state_dict(copied.state_dict())  # a plain FP32 model loads it
            assert torch.equal(plain.fc1.weight, copied.fc1.weight.float())
            before = [m.detach().clone() for g in opt.param_groups for m in g["params"]]
            copied.load_state_dict({k: v * 0 for k, v in copied.state_dict().items()})
            after = [m.detach() for g in opt.param_groups for m in g["params"]]
            assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


class _AbstractNet(abc.ABC, nn.Module):  # ABC first: many research codebases' base class
    @abc.abstractmethod
    def forward(self, x): ...


def _add_layers(model):
    model.fc = nn.Linear(8, 8)
    model.ln = nn.LayerNorm(8)


class _ConcreteNet(_AbstractNet):
    def __init__(self):
        super().__init__()
        _add_layers(self)

    def forward(self, x):
        return self.ln(self.fc(x))


_T = typing.TypeVar("_T")


class _GenericNet(typing.Generic[_T], nn.Module):  # a typed model (Generic first, as ABC)
    def __init__(self):
        super().__init__()
        _add_layers(self)

    forward = _ConcreteNet.forward


@pytest.mark.parametrize("cls", [_ConcreteNet, _GenericNet], ids=["ABC", "Generic"])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_a_model_deriving_from_abc_before_module_is_wrapped(level, cls):
    """``class Base(ABC, nn.Module)`` could not take distamp's class ("__class__ assignment:
    'Net' object layout differs from 'Net'" at wrap, every opt_level; an audit), nor
    ``Generic[T]`` first (then "Cannot inherit from plain Generic"; a review). Now it runs as
    the plain model under torch.autocast would (O1) or in the half dtype (O2/O3), pickles and
    compiles."""
    import io

    torch.manual_seed(0)
    model = distamp.wrap(cls(), opt_level=level, verbosity=0)
    assert isinstance(model, cls)
    x = torch.randn(2, 8)
    out = model(x)
    if level == "O1":
        torch.manual_seed(0)
        plain = cls()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(out, plain(x))
    else:
        assert model.fc.weight.dtype == torch.bfloat16 and out.dtype == torch.float32
        assert model.ln.weight.dtype == (torch.float32 if level == "O2" else torch.bfloat16)
    for copied in (_saved_and_loaded(model, io.BytesIO()), copy.deepcopy(model)):
        assert torch.equal(copied(x), out)
    assert torch.equal(torch.compile(model, backend="eager", fullgraph=True)(x), out)


def test_qat_fake_quantize_modules_take_o2():
    """torch's QAT modules hold fake-quantize observers (``ABC`` before ``nn.Module``, FP32
    buffers, no parameters: kept FP32 like a rotary table), and O2's wrap failed on them with
    the same layout error (an audit). They now run in FP32 on the bf16 weight and train."""
    import torch.ao.nn.qat as nnqat
    from torch.ao.quantization import get_default_qat_qconfig

    torch.manual_seed(0)
    qconfig = get_default_qat_qconfig("x86")
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nnqat.Linear(8, 4, qconfig=qconfig))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    assert model[2].weight_fake_quant.scale.dtype == torch.float32
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    losses = []
    for _ in range(5):
        with distamp.scale_loss(torch.nn.functional.mse_loss(model(x), y), opt) as scaled:
            scaled.backward()
            losses.append(scaled.item())
        opt.step()
        opt.zero_grad()
    assert distamp.stats(opt).skipped_steps == 0 and losses[-1] < losses[0]


def test_a_norm_layer_wrapped_alone_runs_its_own_forward():
    """The model is itself a norm layer kept FP32: its class carries both of distamp's forwards,
    each calling the forward of the class it was put in front of (not itself again)."""
    model = distamp.wrap(nn.LayerNorm(8), opt_level="O2", verbosity=0)
    x = torch.randn(2, 8)
    expected = torch.nn.functional.layer_norm(x.bfloat16().float(), (8,)).bfloat16().float()
    assert torch.equal(model(x), expected)  # in as bf16, computed in FP32, out through bf16


def test_pickling_or_copying_the_wrapped_optimizer_says_to_save_its_state_dict():
    """torch pickles an optimizer as defaults, state and param_groups: a deepcopy lost the FP32
    masters and its step raised AttributeError, pickle failed with "not the same object as
    torch.optim.adamw.AdamW" (an audit). Refused, naming what to save instead."""
    import pickle

    model, opt = wrapped("O2", torch.bfloat16)
    for copy_it in (pickle.dumps, copy.deepcopy, copy.copy):
        with pytest.raises(TypeError, match=r"expected its optimizer\.state_dict\(\)"):
            copy_it(opt)
    state = copy.deepcopy(opt.state_dict())  # the documented road works
    assert torch.equal(state["distamp"]["masters"][0], opt.state_dict()["distamp"]["masters"][0])


def test_an_ema_copy_made_after_o2_wrap_moves_when_updated_through_its_state_dict():
    """timm's ModelEmaV2/V3 pattern: deepcopy after wrap, then write ``ema.state_dict()`` in
    place from ``model.state_dict()``. The copy used to report FP32 copies of its half tensors
    and the EMA never moved (an audit, see [Note: a copy's state dict is live]); the model's
    own state dict stays FP32 (apex's O2 recipe)."""
    model, opt = wrapped("O2", torch.bfloat16)
    ema = copy.deepcopy(model).eval()
    start = ema.fc1.weight.detach().clone()
    for _ in range(3):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        with distamp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # ModelEmaV2._update, decay 0.5
            for ema_v, model_v in zip(
                ema.state_dict().values(), model.state_dict().values(), strict=True
            ):
                if ema_v.is_floating_point():
                    ema_v.copy_(ema_v * 0.5 + 0.5 * model_v)
    assert model.state_dict()["fc1.weight"].dtype == torch.float32
    assert not torch.equal(ema.fc1.weight, start)
    assert torch.allclose(ema.fc1.weight.float(), model.fc1.weight.float(), atol=0.05)


def _saved_and_loaded(model, buffer):
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_two_wrapped_models_are_independent():
    m1, _ = wrapped("O1", torch.bfloat16)
    m2, _ = wrapped("O0", torch.bfloat16)
    m3, _ = wrapped("O1", torch.float16)
    x = torch.randn(2, 8)
    assert set(matmul_dtypes(m1, x)) == {torch.bfloat16}
    assert set(matmul_dtypes(m2, x)) == {torch.float32}
    assert set(matmul_dtypes(m3, x)) == {torch.float16}
    plain = NormMLP()
    assert set(matmul_dtypes(plain, x)) == {torch.float32}  # the original class is untouched


def test_o2_casts_floating_inputs_and_leaves_integer_inputs_alone():
    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.fc = nn.Linear(4, 2)

        def forward(self, ids, extra):
            self.seen = (ids.dtype, extra["w"].dtype)
            return self.fc(self.emb(ids) * extra["w"])

    torch.manual_seed(0)
    model = distamp.wrap(Embed(), opt_level="O2")
    out = model(torch.tensor([[1, 2, 3]]), {"w": torch.ones(1, 3, 1)})
    assert model.seen == (torch.int64, torch.bfloat16)
    assert out.dtype == torch.float32


class Batch:
    """A script's batch class: its to() passes every argument on to every tensor it holds."""

    def __init__(self, tokens, labels, features):
        self.tokens, self.labels, self.features = tokens, labels, features

    def to(self, *args, **kwargs):
        return Batch(*(t.to(*args, **kwargs) for t in (self.tokens, self.labels, self.features)))


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_batch_object_keeps_its_integer_tensors_under_o2_and_o3(level):
    """An audit: apex hands such an object .to(half), which rounded the token ids and labels to
    bf16 (999 -> 1000): a forward taking .long() of them trained on the wrong tokens, silently.
    Its floating tensors are cast, the others left alone, the caller's batch untouched."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(1024, 4)
            self.fc = nn.Linear(4, 4)

        def forward(self, batch):
            self.seen = (batch.tokens.dtype, batch.labels.tolist(), batch.features.dtype)
            return self.fc(self.emb(batch.tokens.long()) + batch.features)

    model = distamp.wrap(Net(), opt_level=level)
    batch = Batch(torch.tensor([3, 517]), torch.tensor([999, 257]), torch.randn(2, 4))
    model(batch)
    assert model.seen == (torch.int64, [999, 257], torch.bfloat16)
    assert batch.features.dtype == torch.float32
    batch.parent = batch  # (a link back to itself: the walk recursed without end, an audit)
    model(batch)
    assert model.seen == (torch.int64, [999, 257], torch.bfloat16)


class BatchDict(dict):
    """A batch type with its own attribute and an update() it forbids (HF ModelOutput style)."""

    def __init__(self, *args, note="batch", **kwargs):
        super().__init__(*args, **kwargs)
        self.note = note

    def update(self, *args, **kwargs):
        raise RuntimeError("update() is not allowed on this batch type")


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_mappings_in_and_out_keep_their_type_under_o2_and_o3(level):
    """A defaultdict (whose constructor needs its factory) or a dict subclass that forbids
    update() goes in and comes out with its type and attributes, floating tensors cast."""
    import collections

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, batch):
            self.seen = (type(batch), batch["x"].dtype, batch["ids"].dtype)
            out = collections.defaultdict(list, logits=self.fc(batch["x"]))
            return out, BatchDict(logits=out["logits"], note="out")

    model = distamp.wrap(Head(), opt_level=level)
    ids = torch.tensor([1, 2])
    batch = collections.defaultdict(list, x=torch.randn(2, 4), ids=ids)
    out, custom = model(batch)
    assert model.seen == (collections.defaultdict, torch.bfloat16, torch.int64)
    assert isinstance(out, collections.defaultdict) and out["missing"] == []
    assert out["logits"].dtype == torch.float32
    assert type(custom) is BatchDict and custom.note == "out"
    assert custom["logits"].dtype == torch.float32
    assert batch["x"].dtype == torch.float32  # the caller's batch is not modified


class InnerDictBatch(MutableMapping):
    """A batch written the usual way for a MutableMapping: its items in an inner dict, which a
    shallow copy shares."""

    def __init__(self, **items):
        self._data = dict(items)

    def __getitem__(self, key):
        return self._data[key]

    def __setitem__(self, key, value):
        self._data[key] = value

    def __delitem__(self, key):
        del self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_mapping_whose_copy_shares_its_items_leaves_the_callers_batch_alone(level):
    """The cast items were written into a shallow copy that shared the caller's inner dict:
    the caller's target came back bf16-rounded after forward (an audit)."""

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, batch):
            self.seen = (type(batch), batch["x"].dtype, batch["target"].dtype)
            return self.fc(batch["x"])

    model = distamp.wrap(Head(), opt_level=level)
    x, target = torch.randn(2, 4), torch.tensor([[0.123456], [0.654321]])
    batch = InnerDictBatch(x=x, target=target)
    assert model(batch).dtype == torch.float32
    # its type kept too: a rebuild from the constructor (which takes **items) fell back to a
    # plain dict, and a forward calling the batch's own methods failed (an audit)
    assert model.seen == (InnerDictBatch, torch.bfloat16, torch.bfloat16)
    assert batch["x"] is x and batch["target"] is target  # the caller's items, untouched


def test_enabled_false_returns_inputs_untouched():
    torch.manual_seed(0)
    model = NormMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m2, o2 = distamp.wrap(model, opt, opt_level="O2", enabled=False)
    assert m2 is model and o2 is opt
    assert type(model) is NormMLP and type(opt) is torch.optim.SGD
    assert model.fc1.weight.dtype == torch.float32


def test_single_in_single_out_lists_in_lists_out():
    ms = [NormMLP(), NormMLP()]
    os_ = [torch.optim.SGD(m.parameters(), lr=0.1) for m in ms]
    out_m, out_o = distamp.wrap(ms, os_, opt_level="O2")
    assert isinstance(out_m, list) and out_m[0] is ms[0] and out_m[1] is ms[1]
    assert isinstance(out_o, list) and out_o[0] is os_[0] and out_o[1] is os_[1]
    only_model = distamp.wrap(NormMLP(), opt_level="O1")
    assert isinstance(only_model, NormMLP)
    for enabled in (True, False):  # a tuple in gives a tuple out (it gave lists)
        m = NormMLP()
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        out_m, out_o = distamp.wrap((m,), (o,), opt_level="O2", enabled=enabled)
        assert type(out_m) is tuple and out_m[0] is m
        assert type(out_o) is tuple and out_o[0] is o


class MaskedAttention(nn.Module):
    """One attention head taking an additive FP32 mask, as Hugging Face's models do."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x, attention_mask):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) + attention_mask
        return (scores.softmax(-1) @ v).float()


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_inputs_cast_down_saturate_so_an_fp32_mask_stays_a_mask(half):
    """An FP32 mask of finfo(float32).min turned -inf in the cast to half; a fully masked
    (padding) row's softmax gave NaN, which spread (NaN losses at O2/O3 every step where FP32
    trained; an audit). Finite values beyond the half range saturate; real inf/NaN stay."""
    values = torch.tensor([torch.finfo(torch.float32).min, -1e9, 1e9, 3.0, -math.inf, math.nan])
    out = cast_floating({"mask": values}, half, saturate=True)["mask"]
    big = torch.finfo(half).max
    expected = torch.tensor([-big, max(-1e9, -big), min(1e9, big), 3.0, -math.inf]).to(half)
    assert out.dtype == half and out[:5].float().tolist() == expected.float().tolist()
    assert math.isnan(out[5].item())
    assert torch.isinf(cast_floating(values, half)[0])  # plain casts elsewhere stay as torch's

    torch.manual_seed(0)
    reference = MaskedAttention()
    model = copy.deepcopy(reference)
    model = distamp.wrap(model, opt_level="O2", half_dtype=half, verbosity=0)
    x = torch.randn(2, 4, 8)
    mask = torch.zeros(2, 1, 4)
    mask[1, 0, :] = torch.finfo(torch.float32).min  # a fully masked row (left padding)
    mask = mask.expand(2, 4, 4)
    out = model(x, attention_mask=mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference(x, mask), atol=0.05, rtol=0)


def test_a_scalar_buffer_cast_with_its_modules_weights_is_named():
    """An audit: a float step counter cast to bf16 at 0 (unchanged, so the lost-precision warning
    never fired) stopped at 256 (x += 1 stays there)."""

    class Counted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("steps", torch.zeros(()))

    model = Counted()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"scalar buffer\(s\) \['steps'\].*past 256"):
        model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    assert model.steps.dtype == torch.bfloat16


@pytest.mark.parametrize("shard", [False, True])
def test_cast_parameters_no_optimizer_holds_are_named_at_wrap(shard):
    """Fine-tuning's optimizer over the trainable parameters only: O2 kept no FP32 copy of the
    frozen backbone's weights, and a consolidated checkpoint widened the rounded ones back to
    "FP32", silently (an audit). Frozen parameters passed to the optimizer keep masters."""
    import warnings

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        model[0].requires_grad_(False)
        return model

    model = build()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=0.1)
    with pytest.warns(UserWarning, match=r"\['0\.weight', '0\.bias'\] are cast to torch\.bfloat16"):
        distamp.wrap(model, opt, opt_level="O2", shard_master_weights=shard, verbosity=0)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*held by no optimizer")
        distamp.wrap(model, opt, opt_level="O2", shard_master_weights=shard, verbosity=0)


class _T5Like(nn.Module):
    """Hugging Face's convention: the class lists modules kept FP32 in a half model."""

    _keep_in_fp32_modules = ("wo",)  # a list in Hugging Face's classes

    def __init__(self):
        super().__init__()
        self.wi = nn.Linear(8, 16)
        self.wo = nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(x + self.wo(torch.relu(self.wi(x))))


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_modules_hugging_face_keeps_fp32_are_named_when_o2_casts_them(opt_level):
    """An audit: T5's ``wo`` (HF's ``_keep_in_fp32_modules``) was cast to fp16 silently."""
    model = _T5Like()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        distamp.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=opt_level)
    named = [str(w.message) for w in seen if "_keep_in_fp32_modules" in str(w.message)]
    if opt_level == "O1":
        assert named == []
    else:
        assert len(named) == 1 and "['wo']" in named[0] and "'wo.weight'" in named[0], named
    # the doctor says it before wrap (an audit: check() was silent)
    said = [f.why for f in distamp.doctor.check(_T5Like(), opt_level, torch.float16)]
    hf = [w for w in said if "_keep_in_fp32_modules" in w]
    assert hf == ([] if opt_level == "O1" else [hf[0]]), said
    assert opt_level == "O1" or "O2 casts them to torch.float16: ['wo.weight'" in hf[0]


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2"])
def test_a_forward_set_on_the_instance_is_named(opt_level):
    """Python calls an instance's own forward before the class's: O1 trained in FP32 silently
    (an audit: accelerate's convert_outputs_to_fp32, user patches)."""
    model = nn.Sequential(nn.Linear(4, 4))
    original = model.forward
    model.forward = lambda x: original(x)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        distamp.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=opt_level)
    named = [w for w in seen if "model.forward is set on the instance" in str(w.message)]
    assert len(named) == (0 if opt_level == "O0" else 1), [str(w.message) for w in seen]
