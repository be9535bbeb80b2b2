"""Fourier transforms over sharded dims: ``sharded_nn.fft`` and a converted model's own ``torch.fft``.

The functions against ``torch.fft`` on the whole tensor (forward and input gradient, float64 and
complex128, uneven slabs, world sizes 2 and 3, a 2x2 mesh); Fourier layers written for one
device (an FNO spectral convolution with its mode crops and index assignments, a FourCastNet
AFNO filter with ``...`` einsums and ``int(total_modes * fraction)``, a 2-D spectral filter on a
2x2 mesh, ``fftshift``/``fftfreq``) converted and compared with the single-device model (forward,
input and parameter gradients); refusals come alike on every rank. Also the guard rules this
needed: index assignment by global positions, ``int()``/``float()`` of sizes read from slabs.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sharded_nn as snn
from sharded_nn.comm import axis_peers, transpose_shards

from .harness import mesh
from .reference import compare_on_slabs, error_on_slab
from .test_merged_tokens import compare_on_blocks

# ------------------------------------------------------------------------------- functions

#: (torch.fft name, input shape, sharded dim, keyword arguments)
CASES = [
    ("fft2", (2, 3, 13, 10), 2, {}),
    ("ifft2", (2, 3, 13, 10), 2, {"norm": "ortho"}),
    ("rfft2", (2, 3, 13, 10), 2, {"norm": "forward"}),
    ("irfft2", (2, 3, 13, 6), 2, {"s": (13, 10)}),
    ("fftn", (2, 3, 13, 10), 2, {"dim": (1, 2)}),
    ("fftn", (2, 3, 13, 10), 3, {}),
    ("rfftn", (2, 3, 13, 10), 2, {"dim": (2, 3)}),
    ("irfftn", (2, 13, 6), 1, {"dim": (1, 2)}),
    ("fft", (13,), 0, {}),  # nothing else to split: one rank transforms
    ("ifft", (2, 13, 2), 1, {"dim": 1}),  # a partner dim shorter than the ring
    ("rfft", (2, 13, 10), 1, {}),  # along a whole dim: local
    ("irfft", (2, 13, 6), 1, {"n": 9}),
]


def _slab(x, m, dim, sizes):
    r = m.get_local_rank("domain")
    return x.narrow(dim, sum(sizes[:r]), sizes[r])


def _functions(world, sizes):
    m = mesh(world)
    for name, shape, dim, kw in CASES:
        torch.manual_seed(0)
        complex_in = name.startswith("i")
        x = torch.randn(shape, dtype=torch.complex128 if complex_in else torch.float64, requires_grad=True)
        n = shape[dim]
        lens = [n - sum(sizes[1:])] + list(sizes[1:]) if len(sizes) == world else None
        y_ref = getattr(torch.fft, name)(x, **kw)
        g = torch.randn_like(y_ref)
        (y_ref.real * g.real).sum().backward() if y_ref.is_complex() else (y_ref * g).sum().backward()
        x_local = _slab(x.detach(), m, dim, lens).clone().requires_grad_()
        y = getattr(snn.fft, name)(x_local, m, **kw, sharded_dims=(dim,))
        g_local = _slab(g, m, dim, lens)
        (y.real * g_local.real).sum().backward() if y.is_complex() else (y * g_local).sum().backward()
        full = snn.gather(y.detach(), m, dims=(dim,))
        torch.testing.assert_close(full, y_ref.detach(), atol=1e-10, rtol=1e-10, msg=lambda s, c=name: f"{c}: {s}")
        gx = snn.gather(x_local.grad, m, dims=(dim,))
        torch.testing.assert_close(gx, x.grad, atol=1e-10, rtol=1e-10, msg=lambda s, c=name: f"{c} grad: {s}")
    return True


@pytest.mark.parametrize("world,sizes", [(2, [0, 4]), (3, [0, 1, 5])])
def test_fft_functions_match_torch(run, world, sizes):
    """Every routed transform, uneven slabs (the first rank takes the rest), forward and backward."""
    assert all(run(world, _functions, world, sizes))


def _two_axes():
    m = mesh((2, 2))
    i, j = m.get_local_rank("domain0"), m.get_local_rank("domain1")
    rows, cols = [5, 2], [3, 4]
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 7, dtype=torch.complex128, requires_grad=True)
    y_ref = torch.fft.fftn(x, dim=(2, 3), norm="ortho")
    g = torch.randn_like(y_ref)
    (y_ref.real * g.real + y_ref.imag * g.imag).sum().backward()

    def block(t):
        return t.narrow(2, sum(rows[:i]), rows[i]).narrow(3, sum(cols[:j]), cols[j])

    x_local = block(x.detach()).clone().requires_grad_()
    y = snn.fft.fftn(x_local, m, dim=(2, 3), norm="ortho", sharded_dims=(2, 3))
    torch.testing.assert_close(y, block(y_ref.detach()), atol=1e-10, rtol=1e-10)
    gl = block(g)
    (y.real * gl.real + y.imag * gl.imag).sum().backward()
    torch.testing.assert_close(x_local.grad, block(x.grad), atol=1e-10, rtol=1e-10)
    # The halved dim of rfft2 is sharded here (W): refused alike.
    with pytest.raises(snn.ShardingError, match="halves"):
        snn.fft.rfft2(x_local.real.detach(), m, sharded_dims=(2, 3))
    return True


def test_fftn_over_both_axes_of_a_2x2_mesh(run):
    assert all(run(4, _two_axes))


def _conjugate_views():
    """Conjugate views reaching the all-to-all: ``torch.fft.ifft`` of a real tensor returns one
    (so ``ifft2`` of a real slab, its whole dim transformed first, crashed in the exchange of the
    sharded one: found by tests/test_fuzz_fft.py), and so does a user's ``x.conj()``; the kept
    modes' inverse of a conjugate view likewise."""
    m = mesh(2)
    r = m.get_local_rank("domain")
    rows = [1, 4]

    def slab(t, d=1):
        return t.narrow(d, sum(rows[:r]), rows[r])

    torch.manual_seed(0)
    real = torch.randn(2, 5, 6, dtype=torch.float64)
    cplx = torch.randn(2, 5, 6, dtype=torch.complex128)
    checks = [
        (lambda t, **kw: snn.fft.ifft2(t, m, **kw), lambda t: torch.fft.ifft2(t), real),
        (lambda t, **kw: snn.fft.ifftn(t, m, dim=(2, 1), **kw), lambda t: torch.fft.ifftn(t, dim=(2, 1)), real),
        (lambda t, **kw: snn.fft.fft(t.conj(), m, dim=1, **kw), lambda t: torch.fft.fft(t.conj(), dim=1), cplx),
    ]
    for ours, theirs, whole in checks:
        x = whole.clone().requires_grad_()
        y_ref = theirs(x)
        g = torch.randn(y_ref.shape, dtype=torch.complex128)
        (torch.view_as_real(y_ref.resolve_conj()) * torch.view_as_real(g)).sum().backward()
        x_l = slab(whole).clone().requires_grad_()
        y = ours(x_l, sharded_dims=(1,))
        torch.testing.assert_close(y, slab(y_ref.detach()), atol=1e-12, rtol=1e-12)
        (torch.view_as_real(y.resolve_conj()) * torch.view_as_real(slab(g))).sum().backward()
        torch.testing.assert_close(x_l.grad, slab(x.grad), atol=1e-12, rtol=1e-12)
    # irfftn_modes of a conjugate view along its sharded halved dim (3 of a real length 6's modes)
    from sharded_nn.fft_modes import irfftn_modes

    def cols(t):
        return t.narrow(2, [0, 2][r], [2, 4][r])

    z = torch.randn(2, 5, 3, dtype=torch.complex128)
    y = irfftn_modes(z.conj(), cols(real), m, (2,), sharded_dims=(2,))
    full = torch.cat([z.conj(), torch.zeros(2, 5, 1, dtype=torch.complex128)], 2)
    torch.testing.assert_close(y, cols(torch.fft.irfft(full, n=6, dim=2)), atol=1e-12, rtol=1e-12)
    return True


def test_conjugate_views_are_transformed(run):
    assert all(run(2, _conjugate_views))


def _transpose_round_trip():
    m = mesh(3)
    ring = axis_peers(m, "domain")
    r = ring.index
    src, dst = [4, 0, 3], [1, 0, 1]  # an empty slab and an empty part
    torch.manual_seed(1)
    whole = torch.randn(2, 7, 2, dtype=torch.complex128)
    x = whole.narrow(1, sum(src[:r]), src[r]).clone().requires_grad_()
    y = transpose_shards(x, ring, 1, 2, src, dst)
    torch.testing.assert_close(y, whole.narrow(2, sum(dst[:r]), dst[r]))
    back = transpose_shards(y, ring, 2, 1, dst, src)
    (back.abs() ** 2).sum().backward()
    torch.testing.assert_close(back, x.detach())
    torch.testing.assert_close(x.grad, 2 * x.detach())
    return True


def test_transpose_shards_moves_uneven_and_empty_pieces(run):
    assert all(run(3, _transpose_round_trip))


def _bad_lengths():
    m = mesh(2)
    x = torch.randn(2, 5 if m.get_local_rank("domain") == 0 else 3, 4)
    out = []
    for call in (lambda: snn.fft.fft(x, m, n=16, dim=1, sharded_dims=(1,)),
                 lambda: snn.fft.rfftn(x, m, dim=(2, 1), sharded_dims=(1,))):
        try:
            call()
            out.append("no error")
        except snn.ShardingError as e:
            out.append(str(e))
    return out


def test_unsupported_transforms_are_refused_alike(run):
    a, b = run(2, _bad_lengths)
    assert a == b
    assert "global length 8" in a[0] and "halves" in a[1]


# ------------------------------------------------------------------------------- models


class SpectralConv2d(nn.Module):
    """An FNO spectral convolution, written for one device (the common public form)."""

    def __init__(self, cin, cout, m1, m2):
        super().__init__()
        self.m1, self.m2, self.cout = m1, m2, cout
        s = 1 / (cin * cout)
        self.w1 = nn.Parameter(s * torch.randn(cin, cout, m1, m2, dtype=torch.complex128))
        self.w2 = nn.Parameter(s * torch.randn(cin, cout, m1, m2, dtype=torch.complex128))

    def forward(self, x):
        b = x.shape[0]
        x_ft = torch.fft.rfft2(x)
        out_ft = torch.zeros(b, self.cout, x.size(-2), x.size(-1) // 2 + 1, dtype=torch.complex128, device=x.device)
        m1, m2 = self.m1, self.m2
        out_ft[:, :, :m1, :m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :m1, :m2], self.w1)
        out_ft[:, :, -m1:, :m2] = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -m1:, :m2], self.w2)
        return torch.fft.irfft2(out_ft, s=(x.size(-2), x.size(-1)))


class FNO2d(nn.Module):
    def __init__(self, modes=4, width=6):
        super().__init__()
        self.lift = nn.Conv2d(3, width, 1)
        self.spectral = nn.ModuleList([SpectralConv2d(width, width, modes, modes) for _ in range(2)])
        self.pointwise = nn.ModuleList([nn.Conv2d(width, width, 1) for _ in range(2)])
        self.proj = nn.Conv2d(width, 1, 1)

    def forward(self, x):
        x = self.lift(x)
        for sc, w in zip(self.spectral, self.pointwise):
            x = F.gelu(sc(x) + w(x))
        return self.proj(x)


class AFNO2D(nn.Module):
    """FourCastNet's adaptive Fourier filter (channels last), written for one device."""

    def __init__(self, hidden, num_blocks=4, sparsity=0.01, fraction=1.0):
        super().__init__()
        self.nb, self.bs, self.sparsity, self.fraction = num_blocks, hidden // num_blocks, sparsity, fraction
        self.w1 = nn.Parameter(0.2 * torch.randn(2, num_blocks, self.bs, self.bs))
        self.b1 = nn.Parameter(0.2 * torch.randn(2, num_blocks, self.bs))
        self.w2 = nn.Parameter(0.2 * torch.randn(2, num_blocks, self.bs, self.bs))
        self.b2 = nn.Parameter(0.2 * torch.randn(2, num_blocks, self.bs))

    def forward(self, x):
        bias = x
        B, H, W, C = x.shape
        x = torch.fft.rfft2(x, dim=(1, 2), norm="ortho")
        x = x.reshape(B, H, W // 2 + 1, self.nb, self.bs)
        o1r = torch.zeros([B, H, W // 2 + 1, self.nb, self.bs], dtype=bias.dtype)
        o1i = torch.zeros([B, H, W // 2 + 1, self.nb, self.bs], dtype=bias.dtype)
        o2r = torch.zeros(x.shape, dtype=bias.dtype)
        o2i = torch.zeros(x.shape, dtype=bias.dtype)
        total = H // 2 + 1
        kept = int(total * self.fraction)
        sl = (slice(None), slice(total - kept, total + kept), slice(None, kept))
        mm = "...bi,bio->...bo"
        re, im = x[sl].real, x[sl].imag
        o1r[sl] = F.relu(torch.einsum(mm, re, self.w1[0]) - torch.einsum(mm, im, self.w1[1]) + self.b1[0])
        o1i[sl] = F.relu(torch.einsum(mm, im, self.w1[0]) + torch.einsum(mm, re, self.w1[1]) + self.b1[1])
        o2r[sl] = torch.einsum(mm, o1r[sl], self.w2[0]) - torch.einsum(mm, o1i[sl], self.w2[1]) + self.b2[0]
        o2i[sl] = torch.einsum(mm, o1i[sl], self.w2[0]) + torch.einsum(mm, o1r[sl], self.w2[1]) + self.b2[1]
        x = torch.stack([o2r, o2i], dim=-1)
        x = F.softshrink(x, lambd=self.sparsity)
        x = torch.view_as_complex(x)
        x = x.reshape(B, H, W // 2 + 1, C)
        x = torch.fft.irfft2(x, s=(H, W), dim=(1, 2), norm="ortho")
        return x + bias


class AFNONet(nn.Module):
    def __init__(self, fraction):
        super().__init__()
        self.embed = nn.Conv2d(2, 8, 3, padding=1)
        self.filter = AFNO2D(8, fraction=fraction)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.embed(x).permute(0, 2, 3, 1)
        return self.head(self.filter(x)).permute(0, 3, 1, 2)


class ShiftedSpectrum(nn.Module):
    """A centred spectrum weighted by its frequency (``fftshift``, ``fftfreq`` of a slab's size)."""

    def forward(self, x):
        s = torch.fft.fftshift(torch.fft.fft(x, dim=2, norm="ortho"), dim=2)
        f = torch.fft.fftshift(torch.fft.fftfreq(x.shape[2], dtype=torch.float64))
        s = s * (1 + f.abs())[:, None]
        return torch.fft.ifft(torch.fft.ifftshift(s, dim=2), dim=2, norm="ortho").real


class SpectralKernel(nn.Module):
    """A kernel of the whole grid made from learned modes (a plain tensor sized from the slab's
    shape, as one device sizes it), applied to the slab."""

    def __init__(self):
        super().__init__()
        self.modes = nn.Parameter(torch.randn(3, 4, 3, dtype=torch.complex128))

    def forward(self, x):
        return x * torch.fft.irfft2(self.modes, s=(x.shape[2], x.shape[3]))


class WholeDimTransform(nn.Module):
    """A transform along a whole dim (W) whose length is read from the sharded one (H): the
    global length, as on one device."""

    def forward(self, x):
        f = torch.fft.rfft(x, n=2 * x.shape[2], dim=3)
        return torch.fft.irfft(f * 0.5, n=x.shape[3], dim=3)


MODELS = {
    "fno": lambda: FNO2d(),
    "afno": lambda: AFNONet(1.0),
    "afno_half_modes": lambda: AFNONet(0.5),
    "shifted": lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), ShiftedSpectrum()),
    "kernel": lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), SpectralKernel()),
    "whole_dim": lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), WholeDimTransform()),
}


def _model_case(world, name, sizes):
    m = mesh(world)
    torch.manual_seed(0)
    ref = MODELS[name]().double()
    model = snn.convert(copy.deepcopy(ref), m, dims=(2,))
    x = torch.randn(2, 3 if name == "fno" else 2, sum(sizes), 10, dtype=torch.float64)
    return compare_on_slabs(ref, model, m, x, sizes, replicated=False)


@pytest.mark.filterwarnings("ignore::sharded_nn.ShardingWarning")  # (convert names the Fourier layers)
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("world,sizes", [(2, [9, 4]), (3, [2, 7, 5])])
def test_fourier_models_are_exact(run, name, world, sizes):
    assert max(run(world, _model_case, world, name, sizes)) < 1e-10


class SpectralFilter2d(nn.Module):
    """A learned filter on the full 2-D spectrum (complex transforms over H and W)."""

    def __init__(self, h, w):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(h, w, dtype=torch.complex128))

    def forward(self, x):
        return torch.fft.ifft2(torch.fft.fft2(x) * self.weight).real


def _filter_on_2x2(rows, cols):
    m = mesh((2, 2))
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), SpectralFilter2d(sum(rows), sum(cols))).double()
    model = snn.convert(copy.deepcopy(ref), m)
    x = torch.randn(2, 2, sum(rows), sum(cols), dtype=torch.float64)
    return compare_on_blocks(ref, model, m, x, rows, cols)


@pytest.mark.filterwarnings("ignore::sharded_nn.ShardingWarning")
def test_spectral_filter_on_a_2x2_mesh(run):
    """fft2 over both sharded dims; the whole-spectrum weight gives each rank its block."""
    assert max(run(4, _filter_on_2x2, [5, 2], [3, 4])) < 1e-10


class HalvedSharded(nn.Module):
    def forward(self, x):
        return torch.fft.irfft2(torch.fft.rfft2(x, dim=(3, 2)), s=(x.shape[3], x.shape[2]), dim=(3, 2))


class PaddedTransform(nn.Module):
    def forward(self, x):
        return torch.fft.fft(x, n=32, dim=2).abs()


class Hermitian(nn.Module):
    def forward(self, x):
        return torch.fft.ihfft(x, dim=2).abs()


class StepAssign(nn.Module):
    def forward(self, x):
        out = torch.zeros_like(x)
        out[:, :, 1::3] = 1.0
        return out


class MisfitAssign(nn.Module):
    def forward(self, x):
        out = torch.zeros_like(x)
        out[:, :, 1:4] = torch.ones(1, 2, 5, 1)
        return out


def _refusals(world, sizes):
    m = mesh(world)
    x = torch.randn(1, 2, sum(sizes), 6)
    makers = (HalvedSharded, PaddedTransform, Hermitian, StepAssign, MisfitAssign)
    return [error_on_slab(snn.convert(make(), m, dims=(2,)), x, m, sizes) for make in makers]


@pytest.mark.filterwarnings("ignore::sharded_nn.ShardingWarning")
def test_unsupported_fourier_calls_are_refused_alike(run):
    a, b = run(2, _refusals, 2, [5, 3])
    assert a == b
    assert ["halves" in a[0], "global length 8" in a[1], "Hermitian" in a[2]] == [True, True, True]
    assert "step other than 1" in a[3] and "the value has 5 rows along dim 2, and the assigned range holds 3" in a[4]


# ------------------------------------------------------------------------------- guard rules


class GlobalAssign(nn.Module):
    """Index assignment by global positions: a slab value (a crop of the input), a plain value of
    the range's whole extent, a value that broadcasts, bounds computed from the slab's size."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Parameter(torch.randn(1, 2, 3, 1, dtype=torch.float64))

    def forward(self, x):
        h = x.shape[2]
        out = torch.zeros_like(x)
        out[:, :, 2:9] = x[:, :, 4:11] * 2
        out[:, :, h - 4 : h - 1] = self.patch
        out[:, :, h // 2 : h // 2 + 1] = x[:, :, :1] + 1
        out[..., 5:, :3] = x[..., :-5, 3:6]
        return out


class IntOfSize(nn.Module):
    """``int()``, ``float()`` and ``math.sqrt`` of sizes read from a slab: the single device's numbers."""

    def forward(self, x):
        h = x.shape[2]
        n = int(h * 0.5)
        scale = float(h) + math.sqrt(h)
        return x[:, :, :n] / scale


def _rule_case(world, name, sizes):
    m = mesh(world)
    torch.manual_seed(0)
    ref = {"assign": GlobalAssign, "int": IntOfSize}[name]().double()
    model = snn.convert(copy.deepcopy(ref), m, dims=(2,))
    x = torch.randn(2, 2, sum(sizes), 7, dtype=torch.float64)
    return compare_on_slabs(ref, model, m, x, sizes, replicated=False)


@pytest.mark.filterwarnings("ignore::sharded_nn.ShardingWarning")
@pytest.mark.parametrize("name", ["assign", "int"])
@pytest.mark.parametrize("world,sizes", [(2, [9, 4]), (3, [6, 1, 6])])
def test_guard_rules_for_spectral_code(run, name, world, sizes):
    assert max(run(world, _rule_case, world, name, sizes)) < 1e-10
