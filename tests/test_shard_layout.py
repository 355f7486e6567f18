"""Block-cyclic shards: every element has one owner, and every bucket is split among all ranks.

See [Note: block-cyclic shards] in distamp/masters/layout.py. Contiguous ZeRO-1 shards give each DDP
bucket to one rank, so its reduce-scatter runs one way over each link; these tests pin down the
layout that makes it run both ways, and that the checkpoint's canonical pieces still cover it.
"""

import pytest
import torch
import torch.nn.functional as F
from dist_harness import SHARD_BLOCK_ENV, run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distamp
from distamp.masters import layout
from distamp.masters.layout import GroupLayout

pytestmark = pytest.mark.xdist_group("multirank")

LAYOUTS = [
    ([5, 30, 1, 17], 2, 7),
    ([100], 3, 7),
    ([3], 4, 7),
    ([40, 40, 9], 4, 5),
    ([13, 2], 1, 4),
    ([1000, 24], 3, 1 << 18),  # one round: exactly contiguous ZeRO-1
]


def _owners(sizes, world, block):
    params = [nn.Parameter(torch.zeros(n)) for n in sizes]
    groups = [GroupLayout(params, 0, world, r, block) for r in range(world)]
    owner: list[tuple[int, int] | None] = [None] * groups[0].padded
    for rank, g in enumerate(groups):
        for index, src, count, dst in g.pieces:
            assert 0 <= dst and dst + count <= g.shard_size
            for k in range(count):
                flat = g.ranges[index].start + src + k
                assert owner[flat] is None, f"element {flat} owned twice"
                owner[flat] = (rank, dst + k)
                assert g.param_offset(index, dst + k) == src + k
    return groups, owner


@pytest.mark.parametrize(("sizes", "world", "block"), LAYOUTS)
def test_every_element_has_exactly_one_owner_and_one_place_in_its_shard(sizes, world, block):
    groups, owner = _owners(sizes, world, block)
    total, size = groups[0].total, groups[0].shard_size
    assert size == -(-total // world)  # the shards of contiguous ZeRO-1, padding included
    assert all(o is not None for o in owner[:total])
    # owned() (what the reduce-scatter hook sends where) agrees with every rank's pieces
    for rank, flat, count, pos in groups[0].owned(0, total):
        assert all(owner[flat + k] == (rank, pos + k) for k in range(count))
    if len(groups[0].rounds) == 1:
        assert all(owner[f] == (f // size, f % size) for f in range(total))


@pytest.mark.parametrize(("sizes", "world", "block"), LAYOUTS)
def test_every_stretch_of_world_blocks_is_owned_by_all_ranks_in_equal_parts(sizes, world, block):
    groups, owner = _owners(sizes, world, block)
    span = world * block
    full_rounds = groups[0].shard_size // block
    for start in range(0, full_rounds * span - span + 1):
        counts = [0] * world
        for f in range(start, start + span):
            if f < groups[0].total:
                counts[owner[f][0]] += 1
        if start + span <= groups[0].total:
            assert counts == [block] * world, (start, counts)


@pytest.mark.parametrize(("sizes", "world", "block"), LAYOUTS)
def test_the_canonical_pieces_cover_every_shard_once(sizes, world, block):
    groups, owner = _owners(sizes, world, block)
    size, total = groups[0].shard_size, groups[0].total
    for piece_of in range(world):
        covered = []
        for holder in range(world):
            for pos, count, at in groups[0].canonical_intervals(holder, piece_of):
                for k in range(count):
                    flat = piece_of * size + at + k
                    if flat < total:
                        assert owner[flat] == (holder, pos + k)
                    covered.append(at + k)
        assert sorted(covered) == list(range(size))


class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(512, 1024)
        self.b = nn.Linear(1024, 512)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _bucket_shares(rank, world):
    model = Wide()  # 1.05M parameters: 2 rounds of distamp's blocks per rank at world 2
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = distamp.wrap(
        model,
        opt,
        opt_level="O2",
        half_dtype=torch.bfloat16,
        shard_master_weights=True,
        verbosity=0,
    )
    ddp = DDP(model, bucket_cap_mb=1)
    state = distamp.hooks.register(ddp, opt, reduce_scatter=True)
    x = torch.randn(4, 512).bfloat16()
    for _ in range(2):  # DDP rebuilds its buckets after the first step
        with distamp.scale_loss(F.mse_loss(ddp(x).float(), torch.zeros(4, 512)), opt) as s:
            s.backward()
        opt.step()
        opt.zero_grad()
    shares = []
    for plan in state._plans.values():
        if plan is not None:
            sent = [sum(p.send_counts[r] for p in plan.pieces) for r in range(world)]
            shares.append(sent)
    return shares


def test_each_bucket_is_reduce_scattered_to_every_rank():
    """With distamp's own block size and 1 MB buckets: every bucket of more than two blocks sends
    each rank about half of it, so both directions of the link carry gradients at once."""
    shares = run_ranks(_bucket_shares, 2)[0]
    big = [s for s in shares if sum(s) > 2 * layout.BLOCK]
    assert big, shares
    for sent in big:
        assert min(sent) >= 0.3 * sum(sent), sent


def _save_or_load_own_state(rank, world, path, load):
    model = Wide()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = distamp.wrap(model, opt, opt_level="O2", verbosity=0)
    if not load:
        torch.save(opt.state_dict(), f"{path}.{rank}")
        return "saved"
    try:
        opt.load_state_dict(torch.load(f"{path}.{rank}", weights_only=True))
    except ValueError as exc:
        return str(exc)
    return "loaded"


def test_a_per_rank_optimizer_state_dict_of_another_block_size_is_refused(tmp_path, monkeypatch):
    """Each rank's optimizer.state_dict() holds its shard; with another block size the same shard
    holds other elements, so loading it must fail with a clear error, not mix weights."""
    path = str(tmp_path / "opt")
    monkeypatch.setenv(SHARD_BLOCK_ENV, "4096")
    assert run_ranks(_save_or_load_own_state, 2, path, False) == ["saved"] * 2
    assert run_ranks(_save_or_load_own_state, 2, path, True) == ["loaded"] * 2
    monkeypatch.delenv(SHARD_BLOCK_ENV)
    for rank, message in enumerate(run_ranks(_save_or_load_own_state, 2, path, True)):
        assert f"rank {rank}'s shard of the FP32 masters of 2 ranks in blocks of 4096" in message
        assert f"in blocks of {layout.BLOCK}" in message
