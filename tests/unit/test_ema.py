"""Weight EMA: the update's closed form, skipped steps, the swap, checkpoints (no DeepSpeed, ZeRO-3), resume, export."""

from __future__ import annotations

import pytest
import torch

from lmrecipe.checkpoint.ema_files import read_ema_state_dict
from lmrecipe.config import load_config
from lmrecipe.errors import UserError
from lmrecipe.observe.host_syncs import HostSyncCounter
from lmrecipe.train.callbacks.ema import WeightAverage

# ---------------------------------------------------------------------------------------------- unit


def closed_form(history: list[dict[str, torch.Tensor]], decay: float) -> dict[str, torch.Tensor]:
    """The bias-corrected EMA after the applied updates of ``history``: a normalised exponentially weighted mean."""
    k = len(history)
    norm = 1 - decay**k
    return {name: sum((1 - decay) * decay ** (k - 1 - i) * w[name] for i, w in enumerate(history)) / norm
            for name in history[0]}


def test_update_matches_the_closed_form_and_skips_leave_it_unchanged():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    ema = WeightAverage(model, 0.9, zero3=False)
    applied = []
    before: list[torch.Tensor] = []
    for step in range(6):
        skip = step == 3
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * (1e6 if skip else 1))  # a skipped step's weights must not count
        ema.update(torch.tensor(skip))
        if not skip:
            applied.append({n: p.detach().clone() for n, p in model.named_parameters()})
        if skip:
            assert all(torch.equal(s, b) for s, b in zip(ema.shadow, before)), "a skipped step moved the average"
        before = [s.clone() for s in ema.shadow]
    assert ema.num_updates.item() == 5
    want = closed_form(applied, 0.9)
    for name, shadow in zip(ema.names, ema.shadow):
        torch.testing.assert_close(shadow, want[name], rtol=1e-6, atol=1e-6)
    # The first applied update copies the weights: nothing of the initialisation remains.
    fresh = WeightAverage(model, 0.999, zero3=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    fresh.update(False)
    assert all(torch.equal(s, p) for s, p in zip(fresh.shadow, model.parameters()))


def test_update_reads_nothing_on_the_host():
    model = torch.nn.Linear(8, 8)
    ema = WeightAverage(model, 0.99, zero3=False)
    flag = torch.tensor(False)
    with HostSyncCounter() as counter:
        for _ in range(3):
            ema.update(flag)
    assert counter.total == 0, counter.calls


def test_swap_evaluates_the_average_and_restores_the_weights_exactly():
    torch.manual_seed(1)
    model = torch.nn.Linear(5, 3)
    ema = WeightAverage(model, 0.5, zero3=False)
    with torch.no_grad():
        model.weight.mul_(3.0)
    ema.update(False)
    ema.update(False)  # shadow == weights after two identical updates; move the weights once more
    with torch.no_grad():
        model.weight.add_(0.25)
    trained = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="inside"):
        with ema.swapped_in():
            assert all(torch.equal(p, s) for p, s in zip(model.parameters(), ema.shadow))
            assert not torch.equal(model.weight, trained[0])
            raise RuntimeError("inside")  # an evaluation that fails still gives the weights back
    assert all(torch.equal(p, t) for p, t in zip(model.parameters(), trained))


def test_save_and_load_round_trip(tmp_path):
    torch.manual_seed(2)
    model = torch.nn.Linear(4, 4)
    ema = WeightAverage(model, 0.7, zero3=False)
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(False)
    ema.update(torch.tensor(True))
    ema.save_files(tmp_path)
    other = WeightAverage(torch.nn.Linear(4, 4), 0.7, zero3=False)
    assert other.load_files(tmp_path) and other.num_updates.item() == 1
    assert all(torch.equal(a, b) for a, b in zip(ema.shadow, other.shadow))
    assert set(read_ema_state_dict(tmp_path)) == {"weight", "bias"}
    assert not WeightAverage(model, 0.7, zero3=False).load_files(tmp_path / "elsewhere")  # no EMA saved: kept, and said


def zero3_like(model: torch.nn.Module, rank: int, world_size: int) -> torch.nn.Module:
    """Give each parameter a ZeRO-3-style partition (``ds_tensor``: ceil(numel / world_size) values, the last one
    zero-padded) and ``ds_shape``, as DeepSpeed does, so WeightAverage(zero3=True) averages this rank's partition."""
    for param in model.parameters():
        size = -(-param.numel() // world_size)
        flat = torch.nn.functional.pad(param.detach().reshape(-1), (0, size * world_size - param.numel()))
        param.ds_tensor, param.ds_shape = flat[rank * size:(rank + 1) * size].clone(), tuple(param.shape)
    return model


def test_ema_loads_across_process_counts_and_zero_stages(tmp_path):
    """An average saved whole loads into ZeRO-3 partitions of any process count, and partitions load whole."""
    torch.manual_seed(3)
    model = torch.nn.Linear(5, 3)  # 15 + 3 values: partitions with padding on 2 processes
    whole = WeightAverage(model, 0.7, zero3=False)
    with torch.no_grad():
        model.weight.mul_(2.0)
    whole.update(False)
    (tmp_path / "whole").mkdir()
    whole.save_files(tmp_path / "whole")
    expected = read_ema_state_dict(tmp_path / "whole")
    for rank in range(2):  # whole -> ZeRO-3 on 2 processes, then back to a whole file
        part = WeightAverage(zero3_like(torch.nn.Linear(5, 3), rank, 2), 0.7, zero3=True, rank=rank, world_size=2)
        assert part.load_files(tmp_path / "whole") and part.num_updates.item() == 1
        part.save_files(tmp_path / "parts")
    assert read_ema_state_dict(tmp_path / "parts").keys() == expected.keys()
    assert all(torch.equal(read_ema_state_dict(tmp_path / "parts")[k], v) for k, v in expected.items())
    again = WeightAverage(torch.nn.Linear(5, 3), 0.7, zero3=False)
    assert again.load_files(tmp_path / "parts")  # ZeRO-3 on 2 -> no DeepSpeed
    assert all(torch.equal(a, b.reshape(a.shape)) for a, b in zip(again.shadow, whole.shadow))
    one = WeightAverage(zero3_like(torch.nn.Linear(5, 3), 0, 1), 0.7, zero3=True, rank=0, world_size=1)
    assert one.load_files(tmp_path / "parts")  # ZeRO-3 on 2 -> ZeRO-3 on 1
    assert all(torch.equal(a, b.reshape(-1)) for a, b in zip(one.shadow, whole.shadow))


def test_config_bounds():
    assert load_config("recipes/tiny.yaml", ["train.ema_decay=0.999"]).train.ema_decay == 0.999
    for bad in ("1.0", "-0.1", "nan"):
        with pytest.raises(UserError, match=r"train.ema_decay=.* must be in \[0, 1\)"):
            load_config("recipes/tiny.yaml", [f"train.ema_decay={bad}"])
    with pytest.raises(UserError, match="checkpoint.export_weights=ema needs a weight EMA"):
        load_config("recipes/tiny.yaml", ["checkpoint.export_weights=ema"])
