"""Which slabs of a converted model's forward share a layout: the guard's layout tokens.

Two slabs of one global length can be laid out differently: crops, ``cat`` along a sharded dim
and strided slices give their results the layout that keeps their source's slab boundaries
(``forward_guard.kept_boundaries``), which is not the layout of every other tensor of that
length. ``torch.cat([x[:, :, :3], x[:, :, 3:]], 2) + x`` on slabs of 4 and 3 rows put rows 3, 4
in the pieces' order: the result's slabs are 3 and 4 rows, ``x``'s 4 and 3. The pointwise call
then raised torch's size error on the ranks whose lengths differ, while the ranks whose lengths
happened to agree went on to the next collective: a hang (or, with three ranks, a collective
paired with another). Before session 64 nothing caught it.

Each slab made in a guarded forward carries a token (a small tuple, or ``None``: the layouts
that sharded layers and the guard's other calls derive from the model's input). A token is made
alike on every rank: from the call that made the tensor and the token of its source, or fresh
from a counter that every rank advances in the same calls. Two tensors with one token have one
layout: a call keeps its input's token only where it keeps the lengths of the sharded dims (a
pointwise call, a permute, a stride-1 "same" convolution, a norm, attention); the relayout of a
crop or ``cat`` names its source's token and the result's global length; any other call that may
change a sharded length gets a fresh token where its input had one (or where the layout scope
forgot during it: a layout no rule derives).

Where a pointwise call, a ``cat`` along another dim or a ``stack`` combines slabs of different
tokens, the guard compares their layouts (one small all-gather of the local lengths, alike on
every rank, as the tokens are alike): the same layout lets the call run as it is; another
layout of the same global length moves the rows of the later operands to the first one's layout (``comm.rebalance.move_rows``, between neighbours;
differentiable), so the call computes what the single device does; different global lengths
raise torch's size error on every rank (a slab of one global row does not broadcast here: the
guard makes such rows replicated, ``x[:, :, :1]``, before they meet a slab). A forward whose slabs all keep the input's token, which
is every forward without crops, ``cat`` along a sharded dim or strided slicing, pays nothing.
"""

from __future__ import annotations

import torch
import torch.nn as nn

UNKNOWN = "unknown"  # (``forward_guard.UNKNOWN``: a layout the guard lost)

__all__ = ["LayoutTokens", "keeps_layout"]

#: Call kinds (``forward_guard._classify``) whose output may have other lengths along a sharded
#: dim than their input: a slab from a tokened input gets a fresh token.
#: (``getitem``, ``pad`` and ``cat`` name their outputs' tokens themselves where they keep or
#: cut a sharded dim; ``split`` along a sharded dim, and ``matmul`` or ``einsum`` changing the
#: length of a dim that stays sharded, are refused.)
RESIZING_KINDS = frozenset({
    "getitem", "narrow", "repeat", "repeat_interleave", "interpolate", "pad", "conv", "pool", "pixel_shuffle",
    "grid_sample", "positional", "fft", "other",
})  # fmt: skip

_WINDOWS = (nn.modules.conv._ConvNd, nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd)
_RESIZING_LAYERS = (
    nn.modules.pooling._AdaptiveAvgPoolNd, nn.modules.pooling._AdaptiveMaxPoolNd, nn.modules.pooling._MaxUnpoolNd,
    nn.modules.pooling._LPPoolNd, nn.FractionalMaxPool2d, nn.FractionalMaxPool3d,
    nn.Upsample, nn.Fold, nn.Unfold, nn.PixelShuffle, nn.PixelUnshuffle, nn.modules.padding._ConstantPadNd,
    nn.modules.padding._ReflectionPadNd, nn.modules.padding._ReplicationPadNd, nn.modules.padding._CircularPadNd,
)  # fmt: skip


def _window_keeps(m: nn.Module) -> bool:
    """Whether a convolution or pooling window gives every input length the same output length
    (stride 1, the padding of both sides together the window's span less one)."""

    def each(v, n):
        return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n

    k = m.kernel_size
    n = len(k) if isinstance(k, (tuple, list)) else 1
    k, s = each(k, n), each(m.stride if m.stride is not None else k, n)
    d = each(getattr(m, "dilation", 1), n)
    if any(v != 1 for v in s) or getattr(m, "ceil_mode", False):
        return False
    if isinstance(m, nn.modules.conv._ConvTransposeNd) and any(each(m.output_padding, n)):
        return False
    p = m.padding
    if p == "same":
        return True
    if p == "valid":
        return all(v == 1 for v in k)
    p = each(p, n)
    return all(2 * pi == di * (ki - 1) for pi, di, ki in zip(p, d, k))


def keeps_layout(module: nn.Module) -> bool:
    """Whether a layer's output has its input's lengths along every dim (so its layout), for
    every input: decided from the module's class and settings alone (alike on every rank), once
    per module. Windows with stride 1 and "same" padding, norms, activations, linear maps,
    attention: yes; strided or unpadded windows, adaptive pools, resampling, pads, folds: no."""
    v = module.__dict__.get("_snn_keeps_layout")
    if v is None:
        if isinstance(module, _WINDOWS):
            v = _window_keeps(module)
        else:
            v = not isinstance(module, _RESIZING_LAYERS)
        module.__dict__["_snn_keeps_layout"] = v
    return v


class LayoutTokens:
    """The forward guard's layout tokens (mixed into ``_GuardMode``; see the module docstring).

    Expects of the mode: ``tokens`` (a ``_States``: tensor -> token; absent means ``None``),
    ``fresh_tokens`` (the counter), ``states``, ``guard``, ``_gather_with_coords``, ``_with_rows``,
    ``_routing``.

    Tokens found to name one layout in a call are not merged for the rest of the forward: a token
    passes through calls that keep it without naming lengths (a reshape that halves a sharded
    dim), so two tokens that agree at one length need not agree at another.
    """

    def _token(self, t):
        return self.tokens.get(t)

    def _fresh_token(self, what: str) -> tuple:
        self.fresh_tokens += 1
        return (what, self.fresh_tokens)

    def _kept_token(self, tok, k: int, lens) -> tuple:
        """The token of a tensor laid out as one of token ``tok`` but with slabs of ``lens`` (every
        rank's lengths, alike on every rank) along mesh axis ``k``: ``("kept", base, k, lens)``, the
        base being ``tok``'s own base where ``tok`` named axis ``k`` already (so a crop then a pad
        back to the first length, or a class token cut off and put back, names the first layout
        again)."""
        if type(tok) is tuple and tok[0] == "kept" and tok[2] == k:
            tok = tok[1]
        return ("kept", tok, k, tuple(lens))

    def _set_token(self, out, tok) -> None:
        for t in (out,) if isinstance(out, torch.Tensor) else _tensors(out):
            if tok is None:
                self.tokens.pop(t, None)
            else:
                self.tokens[t] = tok

    def _pass_tokens(self, kind: str, out, inputs, forgot: bool) -> None:
        """Give the sharded outputs of a call that set none their token (see the module docstring)."""
        # (Windows folded into the batch dim, ``guard_folds``, carry their slab's token through.)
        outs = [t for t in ((out,) if isinstance(out, torch.Tensor) else _tensors(out))
                if self.states.get(t) not in (None, UNKNOWN) and t not in self.tokens]
        if not outs:
            return
        toks = {self._token(t) for t in inputs
                if isinstance(t, torch.Tensor) and self.states.get(t) not in (None, UNKNOWN)}
        if forgot or len(toks) > 1 or (kind in RESIZING_KINDS and toks not in (set(), {None})):
            tok = self._fresh_token(kind)
        else:
            tok = next(iter(toks), None)
        if tok is not None:
            for t in outs:
                self.tokens[t] = tok

    def _align_tokens(self, base: str, args, kwargs, found: list):
        """``args``, ``kwargs`` and ``found`` with every slab among ``found`` in the layout of the
        first one, where their tokens differ (see the module docstring); unchanged otherwise."""
        slabs = [t for t in found if isinstance(t, torch.Tensor) and type(self.states.get(t)) is tuple]
        if len(slabs) < 2 or not self.tokens._d:
            return args, kwargs, found
        reps: dict = {}
        for t in slabs:
            reps.setdefault(self._token(t), t)
        if len(reps) < 2:
            return args, kwargs, found
        n_axes = len(self.guard.axes)
        toks = list(reps)
        # Every representative's local length along each mesh axis (-1: not sharded along it).
        facts = []
        for tok in toks:
            t, st = reps[tok], self.states[reps[tok]]
            facts += [int(t.shape[st[k]]) if st[k] is not None else -1 for k in range(n_axes)]
        self._routing(f"`{base}`")
        rows = self._gather_with_coords(facts, f"forward guard: the layouts of the slabs of `{base}`")
        lines: dict = {}  # (axis, the other coordinates) -> the rows along that line, in axis order
        for k in range(n_axes):
            for r in rows:
                lines.setdefault((k, tuple(r[i] for i in range(n_axes) if i != k)), []).append(r)
        mine = [self._axis_coord(k) for k in range(n_axes)]
        moves: dict = {}  # token -> [(axis, old lengths, new lengths)] on this rank's lines
        for j, tok in enumerate(toks[1:], 1):
            for (k, other), line in lines.items():
                line = sorted(line, key=lambda r: r[k])
                a = [r[n_axes + k] for r in line]
                b = [r[n_axes + j * n_axes + k] for r in line]
                if a[0] < 0 or b[0] < 0 or a == b:
                    continue
                if sum(a) != sum(b):
                    # Torch's own error on one device, raised on every rank (the slabs' sizes differ
                    # on some ranks only: the others would go on to the next collective, a hang).
                    nd = max(t.dim() for t in slabs)
                    d = self.states[reps[toks[0]]][k] + nd - reps[toks[0]].dim()
                    raise RuntimeError(
                        f"The size of tensor a ({sum(a)}) must match the size of tensor b ({sum(b)}) at non-singleton "
                        f"dimension {d} (`{base}` of slabs sharded along it, compared on every rank by sharded_nn's "
                        "forward guard)"
                    )
                if other == tuple(m for i, m in enumerate(mine) if i != k):
                    moves.setdefault(tok, []).append((k, tuple(a), tuple(b)))
        if not moves:
            return args, kwargs, found
        from .comm import axis_peers
        from .comm.rebalance import move_rows

        swap: dict = {}
        for t in slabs:
            steps = moves.get(self._token(t))
            if not steps or id(t) in swap:
                continue
            st, v = self.states[t], t
            for k, new, old in steps:
                v = move_rows(v, st[k], old, new, axis_peers(self.guard.mesh, self.guard.axes[k]))
            self.states[v] = st
            self._set_token(v, toks[0])
            swap[id(t)] = v
        return self._with_rows(swap, args, kwargs, found)

    def _axis_coord(self, k: int) -> int:
        from .mesh import axis_index

        return axis_index(self.guard.mesh, self.guard.axes[k])


def _tensors(obj) -> list:
    from .forward_guard import _flat_tensors

    return _flat_tensors(obj)
