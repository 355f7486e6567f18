"""LossScaler: init, growth, backoff, hysteresis, floor and cap; its state is plain data."""

import math
import warnings

import numpy as np
import pytest
import torch

import distamp
from distamp import LossScaler


def test_dynamic_init_is_2_16_capped_by_max():
    assert LossScaler().scale == 2.0**16
    assert LossScaler(max_loss_scale=2.0**10).scale == 2.0**10
    assert LossScaler(min_loss_scale=2.0**20, max_loss_scale=2.0**24).scale == 2.0**20


def test_grows_2x_after_2000_clean_steps_and_backs_off_half_on_overflow():
    s = LossScaler()
    for _ in range(1999):
        s.update(False)
    assert s.scale == 2.0**16
    s.update(False)
    assert s.scale == 2.0**17
    s.update(True)
    assert s.scale == 2.0**16
    for _ in range(1999):
        s.update(False)
    s.update(True)  # an overflow resets the clean-step count
    for _ in range(1999):
        s.update(False)
    assert s.scale == 2.0**15


def test_growth_is_capped_and_never_non_finite():
    s = LossScaler(max_loss_scale=2.0**17, growth_interval=1)
    for _ in range(10):
        s.update(False)
    assert s.scale == 2.0**17
    s = LossScaler(max_loss_scale=float("inf"), init_scale=2.0**126, growth_interval=1)
    for _ in range(5):
        s.update(False)
    assert s.scale == 2.0**127  # FP32's largest power of two


def test_hysteresis_delays_backoff_but_every_overflow_counts_as_a_skip():
    s = LossScaler(hysteresis=3)
    s.update(True)
    s.update(True)
    assert (s.scale, s.consecutive_skips) == (2.0**16, 2)
    s.update(True)
    assert s.scale == 2.0**15
    s.update(True)
    assert s.scale == 2.0**14  # past the hysteresis every further overflow backs off (apex)
    s.update(False)
    s.update(True)
    assert s.scale == 2.0**14  # a clean step re-arms the hysteresis


def test_floor_holds_and_marks_the_skip():
    s = LossScaler(min_loss_scale=2.0**15)
    s.update(True)
    assert (s.scale, s.skipped_at_floor) == (2.0**15, False)
    s.update(True)
    assert (s.scale, s.skipped_at_floor) == (2.0**15, True)


def test_without_min_loss_scale_the_floor_keeps_the_inverse_finite():
    """apex's default min_loss_scale=None: the scale halved past 2**-128, where 1/scale is no
    FP32 number, and the step crashed inside torch (an audit)."""
    s = LossScaler()
    for _ in range(116):  # 2**16 -> 2**-100
        s.update(True)
    assert (s.scale, s.skipped_at_floor) == (2.0**-100, False)
    s.update(True)
    assert (s.scale, s.skipped_at_floor) == (2.0**-100, True)
    assert math.isfinite(torch.tensor(1.0 / s.scale, dtype=torch.float32).item())


def test_a_loaded_or_initial_scale_below_the_floor_is_raised_to_it():
    """A saved 2**-130 (a run that walked past the floor before it existed) loaded silently and
    the next step crashed inside torch (an audit)."""
    with pytest.warns(UserWarning, match=r"init_scale 7.3\d*e-40 is below .* floor 2\*\*-100"):
        assert LossScaler(init_scale=2.0**-130).scale == 2.0**-100
    with pytest.warns(UserWarning, match=r"init_scale .* below .* floor"):  # torch's API too
        assert distamp.GradScaler(init_scale=2.0**-110).get_scale() == 2.0**-100
    s = LossScaler()
    with pytest.warns(UserWarning, match=r"loss scale 7.3\d*e-40 is outside .*the floor 2\*\*-100"):
        s.set_loaded_scale(2.0**-130, "the checkpoint's")
    assert s.scale == 2.0**-100
    with pytest.warns(UserWarning, match=r"\(min_loss_scale 1\)"):
        LossScaler(min_loss_scale=1.0).set_loaded_scale(2.0**-130, "the checkpoint's")


def test_a_bad_batch_every_few_steps_ends_in_the_clear_error_not_a_crash():
    """The skips never consecutive (max_consecutive_skips never fires), never 2000 clean steps
    to grow back: the default settings walked the scale down to 2**-128 in 720 steps, then
    torch raised "value cannot be converted to type float without overflow" (an audit)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = distamp.wrap(model, opt, opt_level="O2", half_dtype=torch.float16, verbosity=0)
    x = torch.randn(8, 4)
    with pytest.raises(distamp.NonFiniteGradientError, match=r"minimum loss scale 7\.88861e-31"):
        for step in range(300):
            loss = model(x.half()).float().pow(2).mean()
            with distamp.scale_loss(loss * float("inf") if step % 2 else loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
    stats = distamp.stats(opt)
    assert stats.loss_scales[0] == 2.0**-100 and stats.skipped_steps == 117, (step, stats)


def test_a_static_scale_has_no_floor():
    """apex: "If dynamic loss scaling is not used, min_loss_scale is ignored." A static scale at or
    under min_loss_scale made its first skipped step a NonFiniteGradientError (an audit)."""
    for scale, floor in ((1.0, 1.0), (128.0, 512.0)):
        s = LossScaler(scale, min_loss_scale=floor)
        s.update(True)
        assert (s.scale, s.skipped_at_floor, s.consecutive_skips) == (scale, False, 1)


def test_a_static_scale_whose_inverse_overflows_fp32_is_refused():
    """Accepted, then the first step crashed inside torch converting 1 / scale (an audit)."""
    with pytest.raises(ValueError, match=r"loss_scale: expected a static scale whose inverse"):
        LossScaler(2.0**-130)
    assert LossScaler(2.0**-110).scale == 2.0**-110  # a finite inverse still works


def test_static_scale_never_changes():
    s = LossScaler(128.0)
    for overflow in (True, False) * 3000:
        s.update(overflow)
    assert s.scale == 128.0


def test_state_dict_round_trip_and_refusals():
    s = LossScaler()
    s.update(True)
    s.update(False)
    t = LossScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    assert all(isinstance(v, (int, float, bool)) for v in s.state_dict().values())
    with pytest.raises(ValueError, match="static"):
        LossScaler(4.0).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="positive finite"):
        t.load_state_dict({**s.state_dict(), "scale": float("inf")})
    with pytest.raises(ValueError, match="expected keys"):
        t.load_state_dict({"scale": 1.0})


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.5}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"init_scale": 0}, "init_scale"),  # an audit: ZeroDivisionError at the first step
        ({"init_scale": float("nan")}, "init_scale"),  # ... or every step skipped
        ({"init_scale": -8.0}, "init_scale"),
        ({"init_scale": 2.0**30}, "at most max_loss_scale"),  # silently capped at 2**24 before
        ({"loss_scale": 0.0}, "loss_scale"),
        # an audit: taken, every scaled loss inf, and the run blamed the forward pass
        ({"loss_scale": 1e39}, "loss_scale: expected at most FP32's largest"),
        ({"init_scale": 1e39, "max_loss_scale": float("inf")}, "init_scale: expected at most"),
        ({"min_loss_scale": 1e39, "max_loss_scale": float("inf")}, "min_loss_scale"),
        # an audit: init_scale ignored silently beside a static scale
        ({"loss_scale": 128.0, "init_scale": 1024}, "init_scale: expected it only with a dyn"),
        # an audit: numpy's bare "truth value of an array is ambiguous", naming nothing
        ({"loss_scale": np.array([1.0, 2.0])}, "loss_scale: expected"),
        ({"init_scale": np.array([1.0, 2.0])}, "init_scale: expected"),
        ({"growth_interval": 2000.0}, "growth_interval"),  # (torch refuses a float too)
        ({"growth_interval": torch.tensor(2.0)}, "growth_interval"),
    ],
)
def test_bad_settings_are_refused(kw, name):
    with pytest.raises(ValueError, match=name):
        LossScaler(**kw)


def test_wrap_takes_a_loss_scaler_for_the_settings_apex_arguments_do_not_reach():
    """DeepSpeed's fp16 config (``initial_scale_power``, ``loss_scale_window``, ``hysteresis``)
    through ``wrap(..., loss_scale=LossScaler(...))``: each loss gets a fresh scaler with those
    settings; the template itself is never stepped."""
    import torch
    import torch.nn.functional as F
    from models import mlp

    import distamp

    template = LossScaler(init_scale=2.0**12, growth_interval=3, hysteresis=2)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = distamp.wrap(
        model, opt, opt_level="O2", loss_scale=template, num_losses=2, verbosity=0
    )
    scales = []
    for step in range(7):
        x = torch.randn(4, 8) * (float("inf") if step in (0, 1) else 1.0)
        for loss_id in (0, 1):
            loss = F.mse_loss(model(x).float(), torch.zeros(4, 4))
            with distamp.scale_loss(loss, opt, loss_id=loss_id) as scaled:
                scaled.backward()
        opt.step()
        opt.zero_grad()
        scales.append(distamp.stats(opt).loss_scales)
    # hysteresis 2: the first overflow is tolerated, the second backs off; 3 clean steps grow
    assert [s[0] for s in scales] == [2.0**12, 2.0**11, 2.0**11, 2.0**11, 2.0**12, 2.0**12, 2.0**12]
    assert all(a == b for a, b in scales)  # one fresh scaler per loss, the same settings
    assert template.scale == 2.0**12 and template.clean_steps == 0
    with pytest.raises(ValueError, match="min_loss_scale and max_loss_scale on the LossScaler"):
        distamp.wrap(mlp(), None, opt_level="O2", loss_scale=template, max_loss_scale=2.0**10)


def test_an_explicit_init_scale_above_the_default_cap_needs_a_larger_max():
    assert LossScaler(init_scale=2.0**30, max_loss_scale=float("inf")).scale == 2.0**30
    assert LossScaler(max_loss_scale=2.0**10).scale == 2.0**10  # the default start is capped


def test_a_count_past_the_growth_interval_waits_for_the_next_backoff_as_apex_and_torch():
    """apex (``_unskipped == _scale_seq_len``) and torch (``tracker + 1 == interval``) grow only
    when the count reaches the interval exactly: lowered below the count, growth waits."""
    scaler = LossScaler(init_scale=8.0, growth_interval=5)
    for _ in range(3):
        scaler.update(False)
    scaler.growth_interval = 2
    for _ in range(4):
        scaler.update(False)
    assert scaler.scale == 8.0
    scaler.update(True)
    scaler.update(False)
    scaler.update(False)
    assert scaler.scale == 8.0  # backed off to 4, grown back after 2 clean steps


def test_wrap_takes_no_cap_as_deepspeed_and_torch_have_none():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    template = LossScaler(init_scale=2.0**30, max_loss_scale=float("inf"))
    model, opt = distamp.wrap(model, opt, opt_level="O2", loss_scale=template, verbosity=0)
    assert distamp.stats(opt).loss_scales == (2.0**30,)
    other = torch.nn.Linear(2, 2)
    _, opt2 = distamp.wrap(
        other,
        torch.optim.SGD(other.parameters(), lr=0.1),
        opt_level="O2",
        max_loss_scale=float("inf"),
        verbosity=0,
    )
    assert distamp.stats(opt2).loss_scales == (2.0**16,)


@pytest.mark.parametrize(
    "settings,expected,warned",
    [
        ({"max_loss_scale": 2.0**10}, 2.0**10, "max_loss_scale 1024"),
        ({"min_loss_scale": 2.0**20}, 2.0**20, "min_loss_scale 1.04858e+06"),
        ({}, 2.0**16, None),
    ],
)
def test_a_resumed_scale_is_brought_inside_this_runs_bounds(settings, expected, warned):
    """A resume with a lower max_loss_scale kept the saved 65536 above the cap for good; one
    with a higher min_loss_scale resumed below the floor (an audit)."""
    saved = LossScaler(hysteresis=5)
    saved.update(True)  # hysteresis_left 4
    state = saved.state_dict()
    assert state["scale"] == 2.0**16 and state["hysteresis_left"] == 4
    resumed = LossScaler(hysteresis=2, **settings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.load_state_dict(state)
    assert resumed.scale == expected
    assert resumed.hysteresis_left == 2  # within this run's hysteresis
    messages = [str(w.message) for w in caught]
    if warned is None:
        assert messages == []
    else:
        assert len(messages) == 1 and warned in messages[0], messages
        assert "the checkpoint's loss scale 65536" in messages[0]
    for _ in range(resumed.growth_interval):
        resumed.update(False)
    assert resumed.scale <= resumed.max_loss_scale


def test_a_resumed_static_scale_is_this_runs():
    saved = LossScaler(128.0)
    resumed = LossScaler(1024.0)
    with pytest.warns(UserWarning, match="static loss_scale 1024"):
        resumed.load_state_dict(saved.state_dict())
    assert resumed.scale == 1024.0


def test_non_consecutive_hysteresis_walks_the_scale_down_as_deepspeeds_default():
    """DeepSpeed's default config (consecutive_hysteresis false): an overflow every other step
    backs off, 8, 8, 4, 4, 2, ...; distamp's scaler refilled the hysteresis at every clean step,
    so the same run skipped every other step at 8 forever (an audit; no option could say
    otherwise)."""
    overflows = [i % 2 == 0 for i in range(7)]
    s = LossScaler(
        init_scale=8.0,
        growth_interval=3,
        hysteresis=2,
        min_loss_scale=1.0,
        consecutive_hysteresis=False,
        max_loss_scale=float("inf"),
    )
    seq = []
    for overflow in overflows:
        s.update(overflow)
        seq.append(s.scale)
    # DeepSpeed 0.19.8's DynamicLossScaler(init_scale=8, scale_window=3, min_scale=1,
    # delayed_shift=2, consecutive_hysteresis=False), run side by side: the same sequence
    assert seq == [8.0, 8.0, 4.0, 4.0, 2.0, 2.0, 1.0]
    consecutive = LossScaler(init_scale=8.0, growth_interval=3, hysteresis=2)
    for overflow in overflows:
        consecutive.update(overflow)
    assert consecutive.scale == 8.0  # apex's and DeepSpeed's consecutive_hysteresis: true
    grows = LossScaler(
        init_scale=8.0, growth_interval=2, hysteresis=2, consecutive_hysteresis=False
    )
    for overflow in (True, False, False, True):  # a growth refills it: the overflow is tolerated
        grows.update(overflow)
    assert grows.scale == 16.0
    with pytest.raises(ValueError, match="consecutive_hysteresis: expected True or False"):
        LossScaler(consecutive_hysteresis="no")


def test_deepspeeds_loss_scale_zero_is_refused_saying_it_means_dynamic():
    """An audit: a DeepSpeed config's ``"loss_scale": 0`` (dynamic there) copied into wrap or a
    LossScaler got a bare "expected a positive finite number"."""
    with pytest.raises(
        ValueError, match=r'got 0(\.0)? \(DeepSpeed\'s "loss_scale": 0 means dynamic'
    ):
        LossScaler(0)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"means dynamic: loss_scale=\"dynamic\""):
        distamp.wrap(model, opt, opt_level="O2", loss_scale=0)
    with pytest.raises(ValueError, match=r"got -1(\.0)?$"):
        LossScaler(-1)


def test_an_integer_init_scale_is_held_as_a_float():
    """DESIGN: one float per loss (an audit: ``init_scale=2**16`` stayed an int until the scale
    first moved)."""
    scaler = LossScaler(init_scale=2**16, min_loss_scale=1)
    assert type(scaler.scale) is float and scaler.scale == 65536.0


def test_scale_settings_take_any_real_number_and_stay_floats():
    """Reviews: an int cap or floor made the scale an int after a growth or a backoff; numpy and
    torch scalars were refused, 10**400 raised a bare OverflowError; bounds that wrap refuses
    were accepted by LossScaler (max_loss_scale=True started at 1.0); a numeric string was
    refused by LossScaler and taken by wrap."""
    import numpy as np

    scaler = LossScaler(init_scale=4, min_loss_scale=1, max_loss_scale=8, growth_interval=1)
    scaler.update(False)
    assert type(scaler.scale) is float and scaler.scale == 8.0
    for _ in range(5):
        scaler.update(True)
    assert type(scaler.scale) is float and scaler.scale == 1.0
    assert LossScaler(np.float32(128)).scale == LossScaler(torch.tensor(128.0)).scale == 128.0
    assert LossScaler("128.0").scale == 128.0
    assert LossScaler(init_scale=np.int64(4)).scale == 4.0
    # a one-element array as a one-element tensor; integer tensors as torch takes them
    assert LossScaler(np.array(128.0)).scale == 128.0
    assert LossScaler(consecutive_hysteresis=np.bool_(False)).consecutive_hysteresis is False
    assert (
        LossScaler(growth_interval=torch.tensor(5), hysteresis=np.array([2])).settings[
            "growth_interval"
        ]
        == 5
    )
    for bad in (
        {"min_loss_scale": 0},
        {"min_loss_scale": True},
        {"max_loss_scale": True},
        {"min_loss_scale": 16, "max_loss_scale": 8},
        {"init_scale": 10**400},
    ):
        with pytest.raises(ValueError, match=r"expected a positive|must be <="):
            LossScaler(**bad)


def test_numpy_scale_settings_leave_only_plain_numbers_in_the_state_dict(tmp_path):
    """A review: an np.float32 growth_factor made the scale an np.float32 after its first
    growth, and numpy min/max_loss_scale stayed numpy in the properties: the optimizer's state
    dict (and a checkpoint) no longer loaded with weights_only=True."""
    import numpy as np

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(
        init_scale=np.float32(256),
        growth_factor=np.float32(2.0),
        backoff_factor=np.float32(0.5),
        growth_interval=np.int64(1),
        hysteresis=np.int64(1),
        min_loss_scale=np.float32(1.0),
        max_loss_scale=np.float64(2.0**20),
    )
    model, opt = distamp.wrap(model, opt, opt_level="O2", loss_scale=scaler)
    other = torch.nn.Linear(4, 4)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    _, other_opt = distamp.wrap(
        other,
        other_opt,
        opt_level="O2",
        min_loss_scale=np.float32(1.0),
        max_loss_scale=np.float64(2.0**20),
    )
    torch.save(other_opt.state_dict(), tmp_path / "other.pt")
    properties = torch.load(tmp_path / "other.pt", weights_only=True)["distamp"]["properties"]
    assert type(properties["min_loss_scale"]) is float
    assert type(properties["max_loss_scale"]) is float
    for _ in range(2):
        with distamp.scale_loss(model(torch.randn(2, 4)).float().sum(), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    assert distamp.stats(opt).loss_scales == (1024.0,)
    assert all(type(s) is float for s in distamp.stats(opt).loss_scales)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    assert torch.load(tmp_path / "opt.pt", weights_only=True)["distamp"]
