"""CompactAdamW on plain tensors, in one process: the encodings' error bounds, the update
against torch.optim.AdamW, layout independence, state dicts. The distributed behaviour (in
backward, checkpoints) is in ``test_compact_adamw_dist.py``."""

from __future__ import annotations

import copy

import pytest
import torch
from _compact_runs import assert_same_run, nan_gradient_steps, train
from torch import nn

from fused_optim_dist import OptimizerInBackward, _compact_update, _kinds, compact_adamw
from fused_optim_dist._compact_codes import (
    Groups,
    decode_momentum,
    decode_root,
    encode_momentum,
    encode_root,
    join24,
    split24,
)
from fused_optim_dist._compact_update import chunks, update_flat
from fused_optim_dist.compact_adamw import (
    GROUP_SIZE,
    CompactAdamW,
    load_master_weight,
    master_weight,
    to_adamw_state_dict,
)

KWARGS = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def _heavy_tailed(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.randn(n, generator=g).exp()


def test_24_bit_values_keep_16_significant_bits():
    x = _heavy_tailed(4096) * 1e-3
    high, error = split24(x)
    assert high.dtype == torch.bfloat16 and error.dtype == torch.int8
    joined = join24(high, error)
    # bf16 keeps 8 significant bits, the error 8 more: |x - joined| <= ulp(x) / 512.
    assert ((joined - x).abs() <= x.abs() * 2**-15).all()
    # The bfloat16 part is x rounded to nearest (ties aside).
    assert ((high.float() - x).abs() <= x.abs() * 2**-8).all()
    assert ((high.float() - x).abs() > x.abs() * 2**-12).any(), "bf16 alone must be coarser"


def test_24_bit_values_are_the_nearest_24_bits_of_every_pattern():
    """Every low half-word of a positive and a negative float32: the pair joins to the bits
    rounded to a multiple of 2**8 (ties up), and the bfloat16 is that rounded to nearest, the
    rounding edges (an error of +1/2 bfloat16 ULP) included."""
    low = torch.arange(1 << 16, dtype=torch.int64)
    bits = torch.cat([0x3F810000 + low, 0xBF810000 + low])  # 1.0078.. and -1.0078..
    x = bits.to(torch.uint32).view(torch.int32).view(torch.float32)
    high, error = split24(x)
    rounded = (bits + 0x80) & ~0xFF
    joined = join24(high, error).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    assert torch.equal(joined, rounded)
    nearest = ((rounded + 0x8000) >> 16).to(torch.uint16)
    assert torch.equal(high.view(torch.uint16).to(torch.int64), nearest.to(torch.int64))


def _codes(values: torch.Tensor, encode, dtype: torch.dtype, *args):
    """Encode ``values`` (shape (rows, n)) with flat code and scale buffers; return the
    groups, codes and scales."""
    groups = Groups([values.shape])
    code = torch.empty(values.numel(), dtype=dtype)
    scale = torch.empty(groups.count, dtype=torch.bfloat16)
    encode(groups.view(values.reshape(-1)), groups, code, scale, *args)
    return groups, code, scale


@pytest.mark.parametrize("compand", [True, False])
@pytest.mark.parametrize("row", [64, 70])
def test_momentum_codes_within_half_a_step(compand, row):
    m = _heavy_tailed(16 * row).view(16, row)
    groups, code, scale = _codes(m, encode_momentum, torch.int8, compand)
    decoded = decode_momentum(code, scale, groups, compand).reshape(16, row)
    s = (groups.expand(scale.float()) * torch.ones_like(groups.view(code))).reshape(16, row)
    # Largest code step: 1/127 of the scale linear; companded 2/127 near the scale (slope
    # 1/2 there), 1/254 near zero. Plus the bf16 rounding of the scale (2**-8 relative).
    step = s / 127 * (2 if compand else 1)
    assert ((decoded - m).abs() <= step / 2 + m.abs() * 2**-8).all()
    if compand:  # finer than linear near zero
        small = m.abs() < s / 8
        linear = decode_momentum(*_codes(m, encode_momentum, torch.int8, False)[1:], groups, False)
        linear = linear.reshape(16, row)
        assert (decoded - m)[small].abs().mean() < (linear - m)[small].abs().mean()


def test_root_codes_never_zero_for_positive_variance():
    root = _heavy_tailed(64 * GROUP_SIZE).abs().view(-1, GROUP_SIZE)
    root[0, 3] = 0.0
    root[1, 5] = root[1].max() * 1e-6
    groups, code, scale = _codes(root, encode_root, torch.uint8, 8)
    code = code.view(-1, GROUP_SIZE)
    decoded = decode_root(code.reshape(-1), scale, groups, 8)
    assert code[0, 3] == 0 and code[1, 5] == 1
    assert ((code > 0) == (root > 0)).all()
    big = code > 1
    s = scale.float().view(-1, 1).expand_as(root)
    assert ((decoded - root)[big].abs() <= (s / 255 / 2 + root * 2**-8)[big]).all()


def _nibbles_by_the_rule(code: torch.Tensor, row: int) -> torch.Tensor:
    """The 4-bit codes of packed rows as [Note: 4-bit variance] lays them out, element by
    element: in a group of ``n`` (32, the last of a row shorter), byte ``k`` holds element
    ``k`` in its low nibble and ``k + ceil(n / 2)`` in its high one; a group of odd length
    ends in a zero nibble (checked here)."""
    levels = torch.empty(code.shape[0], row, dtype=torch.uint8)
    for r, packed in enumerate(code.tolist()):
        byte = 0
        for start in range(0, row, GROUP_SIZE):
            n = min(GROUP_SIZE, row - start)
            half = -(-n // 2)
            for k in range(half):
                levels[r, start + k] = packed[byte + k] & 0xF
                if k + half < n:
                    levels[r, start + half + k] = packed[byte + k] >> 4
                else:
                    assert packed[byte + k] >> 4 == 0, "the padding nibble is 0"
            byte += half
        assert byte == len(packed)
    return levels


@pytest.mark.parametrize("row", [64, 70, 33])
def test_4_bit_root_codes(row):
    """Two codes to a byte, group by group, in rows of whole bytes; each code the nearest of
    16 levels of the square root of the ratio to the group's scale, never 0 for a positive
    root, so the decoded root is within half a level of that square root."""
    root = _heavy_tailed(8 * row).abs().view(8, row)
    root[0, 3] = 0.0
    root[1, 5] = root[1].max() * 1e-6
    groups = Groups([root.shape], packed=True)
    code = torch.empty(8, -(-row // 2), dtype=torch.uint8)
    scale = torch.empty(groups.count, dtype=torch.bfloat16)
    encode_root(groups.view(root.reshape(-1)), groups, code.view(-1), scale, 4)
    levels = _nibbles_by_the_rule(code, row)
    assert torch.equal(groups.unpack4(code.view(-1)).view(8, row), levels)
    assert levels[0, 3] == 0 and levels[1, 5] == 1
    assert ((levels > 0) == (root > 0)).all() and levels.max() == 15
    decoded = decode_root(code.view(-1), scale, groups, 4).reshape(8, row)
    s = groups.expand(scale.float()) * torch.ones_like(groups.view(root.reshape(-1)))
    s = s.reshape(8, row)
    big = levels > 1
    error = (decoded / s).sqrt() - (root / s).sqrt()  # in levels of 1/15
    assert (error[big].abs() <= 0.5 / 15 + 1e-3).all()
    # Encoding the decoded roots again gives the same codes.
    again = torch.empty_like(code)
    encode_root(groups.view(decoded.reshape(-1)), groups, again.view(-1), scale, 4)
    assert torch.equal(again, code)


def test_groups_never_cross_a_row():
    """A (3, 70) weight: 3 groups per row (32, 32, 6); each row is encoded on its own."""
    torch.manual_seed(0)
    start, grad = torch.randn(3, 70).bfloat16(), torch.randn(3, 70).bfloat16()
    weight = nn.Parameter(start.clone())
    optim = CompactAdamW([weight], **KWARGS)
    weight.grad = grad.clone()
    optim.step()
    state = optim.state[weight]
    assert state["exp_avg_scale"].shape == (3, 3)
    assert state["exp_avg_code"].shape == (3, 70)
    # Row 1 alone, as a one-row shard, gets the same weights, codes and scales.
    row = nn.Parameter(start[1:2].clone())
    row_optim = CompactAdamW([row], **KWARGS)
    row.grad = grad[1:2].clone()
    row_optim.step()
    for key, value in row_optim.state[row].items():
        assert torch.equal(value, state[key] if key == "step" else state[key][1:2]), key
    assert torch.equal(row.detach(), weight.detach()[1:2])


def test_same_result_whatever_is_stepped_with_it():
    """Stepping parameters one by one or together gives the same bits ([Note:
    layout-independent arithmetic]): in backward a bucket holds one FSDP unit, after it all."""
    torch.manual_seed(0)
    shapes = [(3, 70), (17, 33), (64,), (5, 5), (1, 1000)]
    start = [torch.randn(s).bfloat16() for s in shapes]
    grads = [[torch.randn(s).bfloat16() for s in shapes] for _ in range(3)]
    together = [nn.Parameter(t.clone()) for t in start]
    alone = [nn.Parameter(t.clone()) for t in start]
    optim = CompactAdamW(together, **KWARGS)
    optims = [CompactAdamW([p], **KWARGS) for p in alone]
    for step, step_grads in enumerate(grads):
        for index, (p, q, g) in enumerate(zip(together, alone, step_grads, strict=True)):
            # At step 1 two parameters get no gradient: their step counts lag from then on,
            # and the batch mixes counts.
            missing = step == 1 and index in (0, 3)
            p.grad, q.grad = (None, None) if missing else (g.clone(), g.clone())
        optim.step()
        for o in optims:
            o.step()
    counts = {int(optim.state[p]["step"]) for p in together}
    assert counts == {2, 3}
    for p, q, o in zip(together, alone, optims, strict=True):
        assert torch.equal(p.detach(), q.detach())
        for key, value in optim.state[p].items():
            assert torch.equal(o.state[q][key], value), key
    # Each state tensor owns its memory: DCP's asynchronous staging fails on DTensors that
    # share a storage (torch 2.13), so state is never packed into views of one buffer.
    storages = [v.untyped_storage().data_ptr() for e in optim.state.values() for v in e.values()]
    assert len(set(storages)) == len(storages)


@pytest.mark.parametrize("variance_bits", [8, 4])
@pytest.mark.parametrize("chunk_numel", [100, 1000])
def test_large_batches_updated_in_chunks_as_in_one_call(monkeypatch, variance_bits, chunk_numel):
    """[Note: chunked updates]: a batch larger than ``CHUNK_NUMEL`` is updated in chunks of whole
    rows, with the bits of one call. 100 elements: a chunk of one row where a row is longer
    (rows of 1,100 and 2,048), or shorter than a parameter; 1,000: chunks across parameters.
    Rows ending in short groups, an empty shard, vectors, differing step counts, 4-bit codes."""
    args = (torch.bfloat16, torch.bfloat16, True, True)
    whole = train("eager", *args, variance_bits=variance_bits)
    calls = []

    def counted(*update_args):
        calls.append(update_args[0].numel())
        return update_flat(*update_args)

    monkeypatch.setattr(compact_adamw, "update_flat", counted)
    monkeypatch.setattr(_compact_update, "CHUNK_NUMEL", chunk_numel)
    chunked = train("eager", *args, variance_bits=variance_bits)
    assert_same_run(chunked, whole)
    assert len(calls) > 6 * 4  # two groups of a matrix batch and a vector batch, six steps
    assert max(calls) <= max(chunk_numel, 2048)


def test_chunks_hold_whole_rows_and_cover_the_batch(monkeypatch):
    monkeypatch.setattr(_compact_update, "CHUNK_NUMEL", 256)
    shapes = [torch.Size(s) for s in ((3, 100), (0, 64), (2, 300), (4, 2, 16), (9, 33))]
    groups = Groups(shapes, packed=True)
    cut = chunks(shapes, groups, torch.device("cpu"))
    # Rows of 100, of 300 (one per chunk: longer than 256), then rows of 32 and 33 together.
    assert [c.groups.numel for c in cut] == [200, 100, 300, 300, 128 + 3 * 33, 6 * 33]
    assert [(c.elements.start, c.elements.stop) for c in cut][:3] == [
        (0, 200),
        (200, 300),
        (300, 600),
    ]
    assert cut[-1].elements.stop == groups.numel
    assert sum(c.groups.count for c in cut) == groups.count
    assert cut[-1].scales.stop == groups.count
    assert cut[-1].codes.stop == 3 * 50 + 2 * 150 + 4 * 16 + 9 * 17  # packed bytes per row
    vectors = chunks([torch.Size((600,))], None, torch.device("cpu"))
    assert [(c.elements.start, c.elements.stop) for c in vectors] == [
        (0, 256),
        (256, 512),
        (512, 600),
    ]


@pytest.mark.parametrize("variance_bits", [8, 4])
def test_first_step_equals_adamw_on_float32(variance_bits):
    """From zero state the first update uses exact moments: AdamW's step to rounding."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(7, 40)), nn.Parameter(torch.randn(9))]
    reference = copy.deepcopy(params)
    optim = CompactAdamW(params, variance_bits=variance_bits, **KWARGS)
    ref_optim = torch.optim.AdamW(reference, foreach=False, **KWARGS)
    for p, q in zip(params, reference, strict=True):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    optim.step()
    ref_optim.step()
    for p, q in zip(params, reference, strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("variance_bits", [8, 4])
def test_trajectory_close_to_adamw_on_float32(variance_bits):
    """Twenty steps on float32 weights: the 8-bit moments (or a 4-bit variance) move each
    weight within a few percent of AdamW's total displacement."""
    torch.manual_seed(0)
    start = torch.randn(16, 64)
    p, q = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    optim = CompactAdamW([p], variance_bits=variance_bits, **KWARGS)
    ref_optim = torch.optim.AdamW([q], **KWARGS)
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        p.grad = torch.randn(16, 64, generator=g) + 0.5
        q.grad = p.grad.clone()
        optim.step()
        ref_optim.step()
    ours, theirs = (p.detach() - start), (q.detach() - start)
    assert (ours - theirs).norm() < 0.05 * theirs.norm()


@pytest.mark.parametrize("correction", [True, False])
def test_updates_below_half_a_bf16_ulp(correction):
    """Weights near 1 (bf16 ULP 2**-7) updated by about 1e-4 per step: with the error they
    move as float32 weights do; without it bf16 rounds every update away."""
    weight = nn.Parameter(torch.full((4, 32), 1.0, dtype=torch.bfloat16))
    fp32 = nn.Parameter(torch.full((4, 32), 1.0))
    kwargs = dict(lr=1e-4, weight_decay=0.0)
    optim = CompactAdamW([weight], weight_correction=correction, **kwargs)
    ref_optim = CompactAdamW([fp32], **kwargs)
    for _ in range(50):
        weight.grad = torch.ones_like(weight)
        fp32.grad = torch.ones_like(fp32)
        optim.step()
        ref_optim.step()
    if correction:
        # Each step rounds to 1/256 of a bf16 ULP (2**-16 in [0.5, 1)): half of it per step.
        master = master_weight(weight, optim.state[weight])
        torch.testing.assert_close(master, fp32.detach(), atol=50 * 2**-17, rtol=0)
        assert (weight.float() < 1.0).all()
    else:
        assert (weight == 1.0).all(), "bf16 alone loses updates below half an ULP"
        assert "weight_error" not in optim.state[weight]


def _trained(dtype: torch.dtype) -> tuple[list[nn.Parameter], CompactAdamW]:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5, 70).to(dtype)), nn.Parameter(torch.randn(6).to(dtype))]
    optim = CompactAdamW(params, **KWARGS)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        optim.step()
    return params, optim


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_state_dict_round_trip_is_exact(dtype):
    """load_state_dict casts state to the parameters' dtype; every value survives it."""
    params, optim = _trained(dtype)
    loaded = CompactAdamW(params, **KWARGS)
    loaded.load_state_dict(copy.deepcopy(optim.state_dict()))
    for p in params:
        assert optim.state[p].keys() == loaded.state[p].keys()
        for key, value in optim.state[p].items():
            assert loaded.state[p][key].dtype == value.dtype, key
            assert torch.equal(loaded.state[p][key], value), key
    # And both continue alike.
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    optim.step()
    after = [p.detach().clone() for p in params]
    for p, b in zip(params, before, strict=True):
        p.data.copy_(b)
    loaded.step()
    for p, a in zip(params, after, strict=True):
        assert torch.equal(p.detach(), a)


def test_adamw_state_in_and_out():
    """An AdamW state dict loads (quantized); exporting gives AdamW's layout back, within the
    quantization error, and AdamW loads it."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5, 70)), nn.Parameter(torch.randn(6))]
    adamw = torch.optim.AdamW(params, **KWARGS)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        adamw.step()
    compact = CompactAdamW(params, **KWARGS)
    compact.load_state_dict(adamw.state_dict())
    assert compact.state[params[0]]["exp_avg_code"].dtype == torch.int8
    assert compact.state[params[1]]["exp_avg"].dtype == torch.bfloat16
    exported = to_adamw_state_dict(compact.state_dict())
    for index, p in enumerate(params):
        for key in ("exp_avg", "exp_avg_sq"):
            expected = adamw.state[p][key]
            actual = exported["state"][index][key]
            assert actual.shape == expected.shape and actual.dtype == torch.float32
            relative = (actual - expected).norm() / expected.norm()
            assert relative < (2**-14 if p.dim() < 2 else 0.02), (index, key, relative)
    torch.optim.AdamW(params, **KWARGS).load_state_dict(exported)


@pytest.mark.parametrize("in_backward", [False, True])
def test_fp32_run_imported_with_24_bit_weights(in_backward):
    """A float32 AdamW run continues in CompactAdamW on a bfloat16 copy of the model: its state
    dict quantized by ``load_state_dict``, its weights by ``load_master_weight`` to 16
    significant bits (plain bfloat16 would keep 8), then trained on alongside the float32
    run, directly or through ``OptimizerInBackward``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    adamw = torch.optim.AdamW(model.parameters(), **KWARGS)
    batches = [torch.randn(16, 64) for _ in range(6)]
    for x in batches[:3]:
        model(x).square().mean().backward()
        adamw.step()
        adamw.zero_grad()
    compact_model = copy.deepcopy(model).to(torch.bfloat16)
    params = list(compact_model.parameters())
    if in_backward:
        optim = OptimizerInBackward(params, CompactAdamW, **KWARGS)
    else:
        optim = CompactAdamW(params, **KWARGS)
    optim.load_state_dict(adamw.state_dict())
    for p, q in zip(params, model.parameters(), strict=True):
        load_master_weight(optim, p, q.detach())
        master = master_weight(p, optim.state[p])
        ulp = 2.0 ** (torch.frexp(q.detach())[1] - 8)  # a bfloat16 ULP of each weight
        assert ((master - q.detach()).abs() <= ulp / 512).all()
        # The bfloat16 weight is the nearest, or the next one up where the error carries.
        assert ((p.detach().float() - q.detach()).abs() <= ulp * (1 / 2 + 1 / 512)).all()
    for x in batches[3:]:
        model(x).square().mean().backward()
        adamw.step()
        adamw.zero_grad()
        compact_model(x.bfloat16()).float().square().mean().backward()
        optim.step()
        optim.zero_grad()
    for p, q in zip(params, model.parameters(), strict=True):
        error = (master_weight(p, optim.state[p]) - q.detach()).abs().max()
        assert error < 2e-3, error  # bf16 compute and 8-bit moments over 3 steps of lr 1e-2


def test_refusals():
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        CompactAdamW([nn.Parameter(torch.zeros(3, dtype=torch.float16))])
    with pytest.raises(ValueError, match="learning rate"):
        CompactAdamW([nn.Parameter(torch.zeros(3))], lr=-1.0)
    with pytest.raises(ValueError, match="variance_bits must be one of"):
        CompactAdamW([nn.Parameter(torch.zeros(3))], variance_bits=2)


@pytest.mark.parametrize(
    "option", [{"maximize": True}, {"amsgrad": True}, {"decoupled_weight_decay": False}]
)
def test_group_asking_for_another_update_refused(option):
    """A group flag CompactAdamW does not implement was refused on load only: at construction,
    in add_param_group or set on a group later it was ignored (``maximize=True`` still
    minimized), no error."""
    p, q = (nn.Parameter(torch.randn(4, 64, dtype=torch.bfloat16)) for _ in range(2))
    (name,) = option
    named = "its weight decay" if name == "decoupled_weight_decay" else f"it has {name}=True"
    with pytest.raises(ValueError, match=f"cannot add param group 0: {named}"):
        CompactAdamW([{"params": [p], **option}], **KWARGS)
    optim = CompactAdamW([p], **KWARGS)
    with pytest.raises(ValueError, match=f"cannot add param group 1: {named}"):
        optim.add_param_group({"params": [q], **option})
    optim.param_groups[0].update(option)
    p.grad = torch.randn_like(p)
    before = p.detach().clone()
    with pytest.raises(ValueError, match=f"cannot step param group 0: {named}"):
        optim.step()
    assert torch.equal(p.detach(), before) and not optim.state[p]


def test_parameter_listed_twice_refused():
    """torch.optim warns and steps a parameter once per listing (the C kernel did: step 6
    after three steps), where the flat update stepped it once: the paths ended 3.1e-2 apart
    (measured on the code before)."""
    p, q = (nn.Parameter(torch.randn(4, 64, dtype=torch.bfloat16)) for _ in range(2))
    with pytest.raises(ValueError, match="listed twice"):
        CompactAdamW([p, p])
    optim = CompactAdamW([p])
    with pytest.raises(ValueError, match="listed twice"):
        optim.add_param_group({"params": [q, q]})


@pytest.mark.parametrize("kernel", ["c", "eager"])
def test_parameter_converted_after_construction_refused_before_anything_moves(kernel):
    """``module.half()`` after the optimizer was built swaps float16 values in through
    ``.data``. Before, the C kernel stepped them as float32 weights: 4 bytes per element into
    a tensor of 2, past its end. Here the parameter is the first half of a buffer, so that
    the write past its end lands in the second half instead of the heap."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4, 64)) for _ in range(2)]
    optim = CompactAdamW(params, kernel=kernel, **KWARGS)
    for p in params:
        p.grad = torch.randn_like(p)
    optim.step()
    buffer = torch.zeros(2 * 256, dtype=torch.float16)
    buffer[:256] = params[0].detach().reshape(-1)
    params[0].data = buffer[:256].view(4, 64)
    params[0].grad_dtype = None  # a float32 gradient, which the kernel reads
    for p in params:
        p.grad = torch.randn(4, 64)
    before = [p.detach().clone() for p in params]
    with pytest.raises(TypeError, match=r"not torch\.float16"):
        optim.step()
    assert not buffer[256:].any()
    for p, weight in zip(params, before, strict=True):
        assert torch.equal(p.detach(), weight)


@pytest.mark.parametrize("kernel", ["c", "eager"])
@pytest.mark.parametrize(("written", "read"), [(8, 4), (4, 8)])
def test_state_of_other_variance_bits_refused_before_anything_moves(kernel, written, read):
    """``variance_bits`` is fixed for a run: a group changed after its state was written (the
    C kernel's reused table included) raises at the next step, with nothing stepped, where
    reading the codes with the other width would train on garbage."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4, 64, dtype=torch.bfloat16)) for _ in range(2)]
    optim = CompactAdamW(params, variance_bits=written, kernel=kernel, **KWARGS)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        optim.step()
    optim.param_groups[0]["variance_bits"] = read
    before = [(p.detach().clone(), copy.deepcopy(optim.state[p])) for p in params]
    with pytest.raises(ValueError, match=f"another variance_bits than its group's \\({read}\\)"):
        optim.step()
    for p, (weight, state) in zip(params, before, strict=True):
        assert torch.equal(p.detach(), weight)
        assert all(torch.equal(optim.state[p][k], v) for k, v in state.items())


@pytest.mark.parametrize("kernel", ["c", "eager"])
@pytest.mark.parametrize("key", ["exp_avg_scale", "exp_avg_error"])
def test_state_of_another_dtype_refused_before_anything_moves(kernel, key):
    """A state tensor replaced by one of another dtype: the C kernel, which takes each
    tensor's dtype from its layout, wrote a uint8 ``exp_avg_scale`` two bytes an element,
    past its end (here into the second half of its buffer, measured: 8 of 8 bytes), and the
    eager path converted the values into it; both now raise with nothing moved."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(shape, dtype=torch.bfloat16)) for shape in ((4, 64), (64,))]
    optim = CompactAdamW(params, kernel=kernel, **KWARGS)
    for p in params:
        p.grad = torch.randn_like(p)
    optim.step()
    entry = optim.state[params[0] if key == "exp_avg_scale" else params[1]]
    old = entry[key]
    buffer = torch.zeros(2 * old.numel(), dtype=torch.uint8)
    entry[key] = buffer[: old.numel()].view(old.shape)
    for p in params:
        p.grad = torch.randn_like(p)
    before = [(p.detach().clone(), copy.deepcopy(optim.state[p])) for p in params]
    with pytest.raises(TypeError, match=f"holds '{key}' as torch.uint8"):
        optim.step()
    assert not buffer.any()
    for p, (weight, state) in zip(params, before, strict=True):
        assert torch.equal(p.detach(), weight)
        assert all(torch.equal(optim.state[p][k], v) for k, v in state.items())


@pytest.mark.parametrize("kernel", ["c", "eager"])
def test_parameter_reshaped_at_its_address_refused_before_anything_moves(kernel):
    """Rows dropped through ``p.data = p.data[:4]`` after a step keep the parameter's
    address: the reused plan stepped it with the old layout, without an error, where
    torch.optim.AdamW raises (its moments are of the old shape). The C kernel read the new
    gradient past its end and wrote rows no longer part of the parameter (187 of 256 such
    elements, measured). Now refused as AdamW refuses, with nothing moved."""

    def loop(make, refused, match):
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(8, 64, dtype=torch.bfloat16)) for _ in range(2)]
        optim = make(params)
        for _ in range(2):
            for p in params:
                p.grad = torch.randn_like(p)
            optim.step()
        storage = params[0].data
        params[0].data = storage[:4]
        for p in params:
            p.grad = torch.randn_like(p)
        before = storage.clone(), params[1].detach().clone()
        with pytest.raises(refused, match=match):
            optim.step()
        assert torch.equal(storage, before[0]) and torch.equal(params[1].detach(), before[1])

    loop(lambda params: torch.optim.AdamW(params, **KWARGS), RuntimeError, "size of tensor")
    loop(
        lambda params: CompactAdamW(params, kernel=kernel, **KWARGS),
        ValueError,
        r"where its local tensor is \(4, 64\)",
    )


@pytest.mark.parametrize("kernel", ["auto", "eager"])
def test_parameter_transposed_at_its_address_steps_as_its_state_says(kernel):
    """A square matrix transposed through ``p.data = p.data.t()`` keeps its shape and
    address: the reused plan stepped its memory in the old order, pairing each gradient with
    the weight and moments of the transposed element (4.7e-2 after two steps from the same
    state stepped by a new optimizer, measured). Now it steps as a new optimizer on the same
    state does, as torch.optim.AdamW pairs the element ``[i, j]`` of the weight, its gradient
    and moments."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(64, 64, dtype=torch.bfloat16))
    optim = CompactAdamW([p], kernel=kernel, **KWARGS)
    for _ in range(2):
        p.grad = torch.randn_like(p)
        optim.step()
    p.data = p.data.t()
    q = nn.Parameter(p.detach().contiguous())  # the reference's layout is the ordinary one
    fresh = CompactAdamW([q], kernel=kernel, **KWARGS)
    fresh.state[q] = copy.deepcopy(optim.state[p])
    for _ in range(2):
        p.grad = torch.randn(64, 64, dtype=torch.bfloat16)  # contiguous, as autograd's
        q.grad = p.grad.clone()
        optim.step()
        fresh.step()
        fresh._plans.clear()  # always the full path
    assert torch.equal(p.detach(), q.detach())


@pytest.mark.parametrize(
    "change",
    [("variance_bits", 4, "another variance_bits"), ("maximize", True, "has maximize=True")],
)
def test_group_option_changed_refused_before_any_bucket_moves(change):
    """A group option the state or the update cannot follow, set between steps on the group
    stepped last (``variance_bits``: the state's codes are of the other width; ``maximize``:
    not implemented). The plain CompactAdamW stepped the first group, then refused the
    second; in backward the class's step sees one bucket's groups at a time, so the buckets
    stepped before the first one of that group (a bucket of vectors, whose state has no
    width, too) had moved and counted their step. Both now refuse before anything moves."""
    key, value, refusal = change
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)).bfloat16()

    def loop(make):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 40), nn.Tanh(), nn.Linear(40, 8)).bfloat16()
        groups = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters())}]
        optim = make(groups)
        for _ in range(2):
            model(x).float().square().mean().backward()
            optim.step()
            optim.zero_grad()
        optim.param_groups[0][key] = value
        before = [(p.detach().clone(), copy.deepcopy(optim.state[p])) for p in model.parameters()]
        with pytest.raises(ValueError, match=refusal):
            model(x).float().square().mean().backward()
            optim.step()
        for p, (weight, entry) in zip(model.parameters(), before, strict=True):
            assert torch.equal(p.detach(), weight)
            assert entry.keys() == optim.state[p].keys()
            assert all(torch.equal(v, optim.state[p][k]) for k, v in entry.items())

    loop(lambda groups: CompactAdamW(groups, **KWARGS))
    loop(lambda groups: OptimizerInBackward(groups, CompactAdamW, bucket_numel=50, **KWARGS))


@pytest.mark.parametrize("kernel", ["c", "eager"])
def test_a_batch_of_empty_local_shards(kernel):
    """A rank whose shards of an FSDP unit are all empty (a head of one row on two ranks) steps
    a batch of no elements in backward: the eager path raised in its group maxima
    (``segment_reduce`` on nothing); both paths now only count the step."""
    params = [nn.Parameter(torch.zeros(0, n, dtype=torch.bfloat16)) for n in (70, 64)]
    optim = CompactAdamW(params, kernel=kernel)
    for _ in range(2):
        for p in params:
            p.grad = torch.zeros_like(p)
        optim.step()
    assert all(optim.state[p]["step"].item() == 2 for p in params)


def test_declared_elementwise():
    assert _kinds.stepping_of(CompactAdamW, None) is _kinds.Stepping.ELEMENTWISE


@pytest.mark.parametrize("in_backward", [False, True])
def test_adamw_state_loaded_keeps_the_options_built_with(in_backward):
    """An AdamW-layout state dict (``to_adamw_state_dict``'s, the documented way to change
    ``variance_bits``) has no CompactAdamW options: loaded into an optimizer built with
    ``variance_bits=4, weight_correction=False, compand=False`` it keeps them, quantizing into
    4-bit codes. It reset them to the defaults (8-bit codes, 5.125 B/param) without a word."""
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(64, 64, dtype=torch.bfloat16))
    old = CompactAdamW([weight], **KWARGS)
    weight.grad = torch.randn_like(weight)
    old.step()
    exported = to_adamw_state_dict(old.state_dict())
    options = dict(variance_bits=4, weight_correction=False, compand=False)
    cls = (lambda p, **k: OptimizerInBackward(p, CompactAdamW, **k)) if in_backward else None
    # The options given for the group (not the defaults), loaded twice: kept each time.
    new = (cls or CompactAdamW)([{"params": [weight], **options}], **KWARGS)
    for _ in range(2):
        new.load_state_dict(copy.deepcopy(exported))  # no step counter shared
    assert {k: new.param_groups[0][k] for k in options} == options
    assert new.state[weight]["exp_avg_sq_root_code"].shape == (64, 32)
    # Trained as the optimizer built so, from the same state.
    reference = CompactAdamW([nn.Parameter(weight.detach().clone())], **KWARGS, **options)
    reference.load_state_dict(exported)
    for opt, p in ((new, weight), (reference, reference.param_groups[0]["params"][0])):
        p.grad = torch.ones_like(p)
        opt.step()
    assert torch.equal(weight.detach(), reference.param_groups[0]["params"][0].detach())


@pytest.mark.parametrize(
    ("cls", "options", "match"),
    [
        (torch.optim.AdamW, dict(maximize=True), "maximize=True"),
        (torch.optim.AdamW, dict(amsgrad=True), "amsgrad=True"),
        (torch.optim.Adam, dict(weight_decay=0.1), "added to the gradient"),
    ],
)
def test_state_asking_for_another_update_refused_on_load(cls, options, match):
    """A state dict whose groups ask for an update CompactAdamW does not make is refused
    before anything is loaded; it loaded and the flags were ignored (maximize: minimised)."""
    params = [nn.Parameter(torch.randn(4, 32))]
    source = cls(params, lr=1e-2, **options)
    params[0].grad = torch.randn_like(params[0])
    source.step()
    compact = CompactAdamW(params, lr=1e-3)
    with pytest.raises(ValueError, match=match):
        compact.load_state_dict(source.state_dict())
    assert compact.param_groups[0]["lr"] == 1e-3 and not compact.state
    # Adam without weight decay is AdamW's update: it loads.
    adam = torch.optim.Adam(params, lr=1e-2)
    adam.step()
    compact.load_state_dict(adam.state_dict())


def test_kernel_c_refuses_a_parameter_it_cannot_step_at_construction():
    """``kernel="c"`` cannot step a channels_last weight: refused when built (and when a group
    is added), where in backward it raised at that bucket's step, after later buckets had
    moved."""
    conv = nn.Conv2d(3, 8, 3).bfloat16().to(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="not contiguous"):
        CompactAdamW(conv.parameters(), kernel="c")
    with pytest.raises(ValueError, match="not contiguous"):
        OptimizerInBackward(conv.parameters(), CompactAdamW, kernel="c")
    optim = CompactAdamW([conv.bias], kernel="c")
    with pytest.raises(ValueError, match="not contiguous"):
        optim.add_param_group({"params": [conv.weight]})
    assert len(optim.param_groups) == 1
    CompactAdamW(conv.parameters(), kernel="auto")  # the eager path steps it


@_kinds.declare_stepping("elementwise")
class _CompactWithDefault(CompactAdamW):
    """A user's subclass: only a default changed."""

    def __init__(self, params, lr: float = 3e-3, **kwargs) -> None:
        super().__init__(params, lr=lr, **kwargs)


def test_declared_subclass_steps_in_backward():
    """A subclass declared elementwise, as OptimizerInBackward's warning asks, trains as the
    plain subclass. It was refused: the check of state kept on the instance saw the plans,
    caches that differ per bucket by construction (``instance_caches``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4)).bfloat16()
    reference = copy.deepcopy(model)
    optim = OptimizerInBackward(model.parameters(), _CompactWithDefault, bucket_numel=100)
    ref_optim = _CompactWithDefault(reference.parameters())
    for step in range(4):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step)).bfloat16()
        for net, opt in ((model, optim), (reference, ref_optim)):
            net(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.detach(), q.detach())


def test_weights_and_moments_zeroed_in_place_train_on():
    """Magnitude pruning (half a layer's weights zeroed in place after a step) and an AdamW-
    style reset of one-dim moments (``exp_avg.zero_()``) leave a stale error beside a zero:
    a negative one decoded across zero into a NaN, so the weight stayed 0 for good, silently
    (524 of 1,030 pruned weights), and ``master_weight`` was NaN. Such a zero is now decoded
    as zero: the pruned weights regrow as AdamW's do, and both paths give the same bits."""
    runs = []
    for path in ("c", "eager"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 1)).bfloat16()
        optim = CompactAdamW(model.parameters(), lr=1e-3, kernel=path)
        x, y = torch.randn(64, 32).bfloat16(), torch.randn(64, 1)
        weight = model[0].weight
        for step in range(8):
            nn.functional.mse_loss(model(x).float(), y).backward()
            optim.step()
            optim.zero_grad()
            if step == 2:
                with torch.no_grad():
                    pruned = weight.abs() <= weight.abs().flatten().median()
                    weight.masked_fill_(pruned, 0.0)
                for entry in optim.state.values():
                    if "exp_avg_error" in entry:
                        entry["exp_avg"].zero_()
        assert (weight[pruned] != 0).float().mean() > 0.9  # regrown
        for p in model.parameters():
            assert not master_weight(p, optim.state[p]).isnan().any()
            for key in ("exp_avg", "exp_avg_sq"):
                if f"{key}_error" in optim.state[p]:
                    state = optim.state[p]
                    assert not join24(state[key], state[f"{key}_error"]).isnan().any()
        runs.append([p.detach().clone() for p in model.parameters()])
    for p, q in zip(*runs, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "kernel,payload",
    [("c", 0x7FFFFFFF), ("c", 0xFFFFFFFF), ("eager", 0x7FFFFFFF), ("eager", 0xFFFFFFFF)]
    + [("compile", 0x7FFFFFFF)],
)
def test_a_nan_gradient_leaves_weights_nan_as_adamw(kernel, payload):
    """A NaN whose payload fills its low bits (0x7FFFFFFF, the NaN CUDA's arithmetic makes)
    was rounded by the split into bfloat16 and error into a carry through the exponent into
    the sign: -0.0, with no error. The weight (and a vector's moments) silently started again
    from zero where AdamW's is NaN (0xFFFFFFFF: +0.0); found on a GPU, the same on the CPU
    for such a gradient. Now NaN (see [Note: 24-bit weights])."""
    nan_gradient_steps(kernel, payload)


@pytest.mark.parametrize("in_backward", [False, True])
@pytest.mark.parametrize(("saved", "now"), [((30,), (40,)), ((16,), (4096,)), ((4, 64), (6, 64))])
def test_state_of_another_shape_refused_on_load(saved, now, in_backward):
    """State saved for a parameter of another shape (a head resized after the checkpoint) is
    refused by ``load_state_dict``, before anything loads. The C kernel took its lengths from
    the weight and stepped past the state's end: NaN in the bias, then heap corruption."""
    old = nn.Parameter(torch.zeros(saved, dtype=torch.bfloat16))
    optim = CompactAdamW([old])
    old.grad = torch.randn_like(old)
    optim.step()
    new = nn.Parameter(torch.zeros(now, dtype=torch.bfloat16))
    resumed = OptimizerInBackward([new], CompactAdamW) if in_backward else CompactAdamW([new])
    with pytest.raises(ValueError, match="saved for a parameter of another shape"):
        resumed.load_state_dict(optim.state_dict())
    assert not resumed.state


def test_groups_added_later_and_old_states_checked_as_at_construction():
    """A float16 parameter added with ``add_param_group`` (alone or through
    ``OptimizerInBackward``) is refused as at construction (it was stepped, rounded into
    float16); ``master_weight`` of float32 weights is themselves, whatever error a bfloat16
    run's state left (it raised a size mismatch); an AdamW state whose step counts are Python
    numbers (torch before 1.12, which AdamW loads) loads and steps (it raised
    ``AttributeError``)."""
    half = nn.Parameter(torch.randn(4, 40).half())
    for optim in (
        CompactAdamW([nn.Parameter(torch.randn(4, 40).bfloat16())]),
        OptimizerInBackward([nn.Parameter(torch.randn(4, 40).bfloat16())], CompactAdamW),
    ):
        with pytest.raises(TypeError, match="bfloat16 or float32"):
            optim.add_param_group({"params": [half]})
        assert len(optim.param_groups) == 1
    weight = nn.Parameter(torch.randn(4, 40).bfloat16())
    optim = CompactAdamW([weight])
    weight.grad = torch.randn_like(weight)
    optim.step()
    as_float = nn.Parameter(weight.detach().float())
    resumed = CompactAdamW([as_float])
    resumed.load_state_dict(optim.state_dict())
    assert torch.equal(master_weight(as_float, resumed.state[as_float]), as_float.detach())
    adamw = torch.optim.AdamW([as_float])
    as_float.grad = torch.randn_like(as_float)
    adamw.step()
    old = adamw.state_dict()
    old["state"][0]["step"] = int(old["state"][0]["step"])
    resumed = CompactAdamW([as_float])
    resumed.load_state_dict(old)
    resumed.step()
    assert resumed.state[as_float]["step"].item() == 2


def test_named_parameters_taken_as_torch_optim_takes_them():
    """``model.named_parameters()``, as torch.optim takes it: CompactAdamW alone and through
    ``OptimizerInBackward``, and a named group added later (the new checks of added groups
    read the pairs as parameters and raised ``AttributeError``)."""
    model = nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 4)).bfloat16()
    CompactAdamW(model[0].named_parameters())
    optim = OptimizerInBackward(model[0].named_parameters(), CompactAdamW)
    optim.add_param_group({"params": model[1].named_parameters()})
    assert optim.param_groups[1]["param_names"] == ["weight", "bias"]
    model(torch.randn(2, 8).bfloat16()).float().sum().backward()
    optim.step()
    assert all(optim.state[p]["step"].item() == 1 for p in model.parameters())
    # An unnamed group among named ones is refused, as torch.optim refuses it, after a step
    # too (the class's own check sees no groups between steps).
    with pytest.raises(ValueError, match="with/without names"):
        optim.add_param_group({"params": [nn.Parameter(torch.zeros(2, 32).bfloat16())]})
