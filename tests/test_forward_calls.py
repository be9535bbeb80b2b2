"""The forward guard: position-mixing calls inside a converted model's own ``forward``.

Each hazard is called on slabs (uneven where the model allows) at P = 2 and 3: either the
converted model equals the single-device one (forward, input and parameter gradients, float64),
or every rank raises the same ``ShardingError`` naming the call, the module and the source line.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sharded_nn as snn
from sharded_nn.forward_guard import guard_active

from .harness import mesh
from .reference import check_against_reference, error_on_slab


class Hazards(nn.Module):
    """A model whose own forward calls one position-mixing op, chosen by ``kind``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.head = nn.Conv2d(4, 3, 1)
        if kind.startswith("fconv"):
            # Weights of a convolution the model's forward calls itself (F.conv2d).
            shapes = {"fconv_strided": (4, 2, 3, 3), "fconv_1x1_strided": (4, 4, 1, 1)}
            self.w2 = nn.Parameter(torch.randn(shapes.get(kind, (4, 4, 3, 3))) * 0.3)
            self.b2 = nn.Parameter(torch.randn(4) * 0.1)
        if kind.endswith("_norm_call") or kind == "instance_norm_running":
            # Affine parameters of a norm the model's forward calls itself (F.group_norm, ...).
            self.nw = nn.Parameter(1 + torch.randn(4) * 0.3)
            self.nb = nn.Parameter(torch.randn(4) * 0.1)
        if kind.startswith("table_"):
            # A learned table looked up at positions computed on the slab (MViT-v2's relative
            # position tables, a learned row embedding).
            self.table = nn.Parameter(torch.randn(5, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x))
        k = self.kind
        if k == "interpolate_local_size":
            s = F.interpolate(F.avg_pool2d(h, 2), size=h.shape[2:], mode="bilinear", align_corners=False)
            h = h + s
        elif k == "interpolate_scale":
            h = F.interpolate(h, scale_factor=2, mode="nearest")
        elif k == "pad":
            h = F.pad(h, (1, 2, 2, 1), mode="replicate")
        elif k == "pad_circular":
            h = F.pad(h, (0, 0, 1, 1), mode="circular")
        elif k == "pad_parity":  # timm Swin's PatchMerging: pad to even sizes, read from the tensor
            _, _, hh, ww = h.shape
            h = F.pad(h, (0, ww % 2, 0, (hh + 1) % 2))  # a row at the end when the (global) height is even
            h = h[:, :, :-1] if (hh + 1) % 2 else h
        elif k == "max_pool":
            h = F.max_pool2d(h, 3, stride=2, padding=1)
        elif k == "avg_pool":
            h = F.avg_pool2d(h, 2)
        elif k == "adaptive_pool":
            h = h * torch.sigmoid(F.adaptive_avg_pool2d(h, 1))
        elif k == "mean":  # squeeze-excite
            h = h * torch.sigmoid(h.mean((2, 3), keepdim=True))
        elif k == "sum":
            h = h - h.sum(dim=(2, 3), keepdim=True) / 100
        elif k == "amax":
            h = h / (1 + torch.amax(h, dim=(1, 2), keepdim=True).abs())
        elif k == "max_all":
            h = h - h.max()
        elif k == "roll":
            h = torch.roll(h, shifts=(2, -1), dims=(2, 3))
        elif k == "roll_back":
            h = torch.roll(h, -3, 2)  # a halo of 3 from the right neighbour
        elif k == "window_partition":
            n, c, hh, ww = h.shape
            w = h.permute(0, 2, 3, 1).reshape(n, hh // 2, 2, ww // 2, 2, c)
            w = w.permute(0, 1, 3, 2, 4, 5).reshape(-1, 4, c)  # windows: attention inside each
            a = torch.softmax(w @ w.transpose(1, 2), dim=-1) @ w
            h = a.reshape(n, hh // 2, ww // 2, 2, 2, c).permute(0, 5, 1, 3, 2, 4).reshape(n, c, hh, ww)
        elif k == "window_partition_batched":  # batch 2: windows of both samples merge in dim 0
            n, c, hh, ww = h.shape
            w = h.permute(0, 2, 3, 1).reshape(n, hh // 2, 2, ww // 2, 2, c)
            w = w.permute(0, 1, 3, 2, 4, 5).reshape(-1, 4, c)
            h = (torch.softmax(w @ w.transpose(1, 2), dim=-1) @ w).reshape(n, c, hh, ww)
        elif k == "cat_split":
            a, b = torch.split(h, 2, dim=1)
            h = torch.cat([b, a, a * b], dim=1)[:, :4]
        elif k == "cat_sharded":
            h = torch.cat([h, h], dim=2)[:, :, : h.shape[2]]
        elif k == "cat_pieces":  # layouts of one global length that differ (a hang before session 64)
            n = h.shape[2]
            h = h + torch.cat([h[:, :, :3], h[:, :, 3:]], 2)  # pieces put back together
            h = h * torch.cat([h[:, :, 2:], h[:, :, :2]], 2).tanh()  # rows rolled by hand (refused before)
            h = h + F.pad(h[:, :, 1:], (0, 0, 0, 1))  # a crop padded back at the other end
            h = h - torch.cat([h[:, :, :1], h[:, :, 1 : n - 2] * 2, h[:, :, n - 2 :]], 2)
            h = torch.stack([h, F.pad(h[:, :, :-3], (0, 0, 3, 0))], 0).sum(0)  # a shift by three rows
        elif k == "split_rows":  # chunks and splits of the sharded rows (refused before session 64)
            a, b = h.chunk(2, dim=2)
            top, mid, rest = torch.split(h, [3, 1, h.shape[2] - 4], dim=2)
            parts = h.tensor_split(3, dim=2)
            h = torch.cat([b, a], 2) + torch.cat([rest, mid, top], 2) * 0.5 + torch.cat(parts[::-1], 2) * 0.25
            h = h + torch.cat(h.split(h.shape[2] // 3, 2)[::-1], 2) + h.tensor_split([2, -3], 2)[1].mean(2, True)
        elif k == "unbind_rows":
            h = h + torch.stack(h.unbind(2), 2)
        elif k == "crop_sizes_differ":  # torch's size error on one device: on every rank
            h = h[:, :, 1:] + h[:, :, :-2]
        elif k == "flip":  # mirrored rows and columns (test-time augmentation; refused before session 62)
            h = h + torch.flip(h, dims=(2,)) * 0.5 + h.flip(-1, 1) * 0.25 + torch.flip(h * 2, (2, 3)).flip(2)
        elif k == "std":
            h = h / h.std(dim=(2, 3), keepdim=True)
        elif k == "std_positional":  # Tensor.std(dim, unbiased, keepdim)
            h = h / (1 + h.std(2, False, True))
        elif k == "var_mean":
            v, mu = torch.var_mean(h, (2, 3), correction=0, keepdim=True)
            h = (h - mu) / (v + 1e-5).sqrt()
        elif k == "grn":  # ConvNeXt-V2's global response norm (channels first)
            g = h.norm(p=2, dim=(2, 3), keepdim=True)
            h = h + h * (g / (g.mean(dim=1, keepdim=True) + 1e-6))
        elif k == "vector_norm_inf":
            h = h / (1 + torch.linalg.vector_norm(h, float("inf"), dim=2, keepdim=True))
        elif k == "vector_norm_all":  # no dim: every dim, sharded ones included
            h = h / torch.linalg.norm(h)
        elif k == "normalize_rows":  # F.normalize along the sharded dim
            h = F.normalize(h, p=3, dim=2)
        elif k == "matrix_norm":
            h = h / torch.linalg.norm(h, ord="nuc", dim=(2, 3), keepdim=True)
        elif k == "position_grid":
            ys = torch.linspace(-1, 1, h.shape[2], dtype=h.dtype)
            h = h + ys.view(1, 1, -1, 1)
        elif k == "position_rows":  # row indices and a log grid over the sharded rows: global ones
            rows = torch.arange(h.shape[2], dtype=h.dtype).view(-1, 1)
            h = h * (rows / 10) + torch.logspace(0, 1, steps=h.shape[2], dtype=h.dtype).view(1, 1, -1, 1)
            h = h + torch.arange(0, h.shape[2])[None, None, :, None] % 3
        elif k == "position_offset":  # arange bounds computed from the slab's rows (XCiT's position grid)
            rows = torch.arange(1, h.shape[2] + 1, dtype=h.dtype)
            evens = torch.arange(0, 2 * h.shape[2], 2, dtype=h.dtype)
            h = h * (rows / rows[-1:]).view(1, 1, -1, 1) + (evens % 3).view(1, 1, -1, 1)
        elif k == "repeat_rows":  # a plain grid tiled to the slab's rows: a slab of the global grid
            cols = torch.arange(1, h.shape[3] + 1, dtype=h.dtype).repeat(1, h.shape[2], 1)  # (1, H, W)
            h = h + cols / cols[:, :, -1:]
        elif k == "repeat_tiles":  # pairs of rows tiled by the slab's half height: not a slab of anything
            h = h + torch.arange(2, dtype=h.dtype).view(2, 1).repeat(h.shape[2] // 2, 1)
        elif k == "cumsum_rows":  # a running sum over the sharded rows (EdgeNeXt's mask positions)
            h = h + torch.cumsum(h, dim=2) * 0.1 + torch.ones_like(h).cumsum(2, dtype=torch.float32).to(h.dtype) / 10
        elif k == "group_norm_call":  # F.group_norm in the model's own forward (timm's GroupNorm1 subclasses)
            h = F.group_norm(h, 2, self.nw, self.nb, 1e-5) + F.group_norm(h, 1, self.nw, None, eps=1e-6)
        elif k == "instance_norm_call":
            h = F.instance_norm(h, weight=self.nw, bias=self.nb) + F.instance_norm(h)
        elif k == "instance_norm_running":  # updates running statistics: refused
            h = F.instance_norm(h, torch.zeros(4, dtype=h.dtype), torch.ones(4, dtype=h.dtype), self.nw, self.nb)
        elif k == "position_step":  # every other row: not a slab of rows
            h = h + torch.arange(0, h.shape[2], 2, dtype=h.dtype).sum()
        elif k == "slice_rows":  # a crop by global position: the first rank loses its first row
            h = h[:, :, 1:]
        elif k == "stride_rows":  # slabs start on even rows: one phase of a 2-way split
            h = h[:, :, ::2]
        elif k == "phase_pairs":  # space-to-depth / patch merging: both phases, side by side
            h = torch.cat([h[:, :, 0::2], h[:, :, 1::2, :]], 1)[:, :4] * 0.5
        elif k == "stride_rows_misaligned":  # a slab starts on row 6: not a multiple of 4
            h = h[:, :, 1::4]
        elif k == "crop_noop":
            h = h[:, :, : h.shape[2], 1:]
        elif k == "attention_tokens":  # routed to ring attention
            t = h.flatten(2).transpose(1, 2)  # (N, L, C): L sharded
            h = F.scaled_dot_product_attention(t, t, t).transpose(1, 2).reshape(h.shape)
        elif k == "attention_heads_causal":
            n, c, hh, ww = h.shape
            t = h.flatten(2).transpose(1, 2).reshape(n, hh * ww, 2, c // 2).transpose(1, 2)  # (N, 2, L, C/2)
            a = F.scaled_dot_product_attention(t, t * 0.5, t, is_causal=True, scale=0.7)
            h = a.transpose(1, 2).reshape(n, hh * ww, c).transpose(1, 2).reshape(h.shape)
        elif k == "attention_pooled_kv":  # PVT-style spatial reduction: keys from a 2x2 pool
            q = h.flatten(2).transpose(1, 2)
            kv = F.avg_pool2d(h, 2).flatten(2).transpose(1, 2)
            h = F.scaled_dot_product_attention(q, kv, kv * 2).transpose(1, 2).reshape(h.shape)
        elif k == "attention_latent_query":  # a learned query over every token: replicated
            t = h.flatten(2).transpose(1, 2)
            latent = self.head.weight[:1, :, 0, 0].expand(t.shape[0], 1, -1) * 3
            pooled = F.scaled_dot_product_attention(latent, t, t)  # (N, 1, C)
            h = h + pooled.transpose(1, 2).unsqueeze(-1)
        elif k == "attention_mask":
            t = h.flatten(2).transpose(1, 2)
            mask = torch.ones(t.shape[1], t.shape[1], dtype=torch.bool)
            h = F.scaled_dot_product_attention(t, t, t, attn_mask=mask).transpose(1, 2).reshape(h.shape)
        elif k == "softmax_tokens":  # attention written out: softmax over the sharded key dim
            t = h.flatten(2).transpose(1, 2)  # (N, L, C)
            w = torch.softmax(self.head.weight[:2, :, 0, 0] @ t.transpose(1, 2), dim=-1)  # (N, 2, L)
            pooled = w @ t  # contracts the sharded tokens: replicated (N, 2, C)
            h = h + pooled.sum(1)[:, :, None, None] + F.log_softmax(h, dim=2) * 0.1 + F.softmin(h, 2, dtype=h.dtype)
        elif k == "linear_attention":  # k^T v contracts the sharded tokens (EfficientViT's LiteMLA)
            t = h.flatten(2).transpose(1, 2)
            kv = F.relu(t).transpose(1, 2) @ t  # (N, C, C): replicated
            h = h + (F.relu(t) @ kv / 50).transpose(1, 2).reshape(h.shape)
        elif k == "fconv_std":  # weight standardisation (timm's StdConv2d, NFNets' ScaledStdConv2d)
            w = self.w2 - self.w2.mean((1, 2, 3), keepdim=True)
            w = w / (w.std((1, 2, 3), keepdim=True) + 1e-5)
            h = F.conv2d(h, w, self.b2, padding=1)
        elif k == "fconv_strided":
            h = F.conv2d(h, self.w2, self.b2, 2, 2, 2, 2)
        elif k == "fconv_same":
            h = F.conv2d(h, self.w2 * 2, self.b2, padding="same")
        elif k == "fconv_1x1_strided":
            h = F.conv2d(h, self.w2, self.b2, stride=2)
        elif k == "fconv_local_pad":  # 1, but derived from the slab's local size
            h = F.conv2d(h, self.w2, self.b2, padding=h.shape[2] // h.shape[2])
        elif k == "fconv_transpose":
            h = F.conv_transpose2d(h, self.w2, self.b2, stride=2)
        elif k == "size_mean":  # a squeeze-excite mean written by hand: a sum over the global count
            n, c, hh, ww = h.shape
            h = h * torch.sigmoid(h.sum((2, 3), keepdim=True) / (hh * ww) * 3)
        elif k == "size_tokens":  # mean over tokens by their count
            t = h.flatten(2).transpose(1, 2)  # (N, L, C): L sharded
            h = h + (t.sum(1) / t.size(1))[:, :, None, None]
        elif k == "size_numel":
            h = h / h.numel() * 100 + h.abs().sum() / h[:1].numel()
        elif k == "size_tensor":  # numbers from sizes made into tensors
            hh, ww = h.shape[2], h.shape[3]
            h = h * torch.tensor(hh**0.5, dtype=h.dtype) + torch.full((1, 4, 1, 1), hh, dtype=h.dtype) / 10
            h = h + h.new_full((1, 1, 1, 1), hh * ww + 1) / 50 + torch.scalar_tensor(-ww, dtype=h.dtype) / 7
        elif k == "size_scalars":  # sizes as scalars of pointwise calls (int and float arithmetic)
            hh, ww = h.shape[2:]
            h = torch.clamp(h * (1 / ww) * (hh % 5 + 1), max=hh / 40) + torch.add(h, h, alpha=hh // 3) * ww**-0.5
        elif k == "branch_pad":  # a branch on a size with a routed call in it (hung: ranks disagreed)
            if h.shape[2] % 4 == 2:
                h = F.pad(h, (0, 0, 0, 2)) * 0.5
        elif k == "branch_truth":  # a branch on a size's truth value (ranks disagreed silently)
            h = h * 2 if h.shape[2] % 4 else -h
            if not (h.shape[2] > 5 and h.shape[3] > 5):
                h = h + 1
        elif k == "item_of_sum":  # a routed sum is replicated: reading it is fine
            h = h * float(h.sum())
        elif k == "whole_domain_operand":  # a fixed-size embedding of all rows added to a slab
            h = h + torch.linspace(0, 1, self.rows, dtype=h.dtype)[:, None]
        elif k == "view_whole_minus_one":  # a constant of the whole sample's shape beside a -1: read globally
            h = h.reshape(-1, self.rows * h.shape[3]).reshape(h.shape)
        elif k == "view_minus_one_inner":  # a -1 view that puts the sharded rows inside a merged dim
            # (3 splits the columns: the -1 takes the rows behind the batch and channels, a fold the
            # guard follows and unfolds again; refused before session 67)
            h = h.reshape(-1, 3).reshape(h.shape)
        elif k == "view_minus_one_across":  # a constant that splits no dim: read as the whole sample's
            h = h.reshape(-1, 4).reshape(h.shape)
        elif k == "setitem_const":  # the first 8 rows of the whole sample (refused before session 56)
            h = h.clone()
            h[:, :, :8] = 0.0
        elif k == "setitem_positions":  # boundary conditions by integer position (refused before session 62)
            h = h.clone()
            h[:, :, 0] = 0.0  # a wall: the whole sample's first row
            h[..., -1, :] = torch.linspace(0, 1, h.shape[3], dtype=h.dtype)  # the last row, a plain profile
            h[:, 1, h.shape[2] - 2] = h[:, 0, 1] * 3  # a row by a position read from the size; one row's values
            h[:, 2, 3, -1] = 5.0  # one element (on a 2-D mesh: one rank's)
            h[:, 0] = h[:, 0] * 2  # an integer position along an unsharded dim, a slab value
        elif k == "diff_rows":  # finite differences along the sharded rows (a total variation, a physics loss)
            d1 = torch.diff(h, dim=2)  # (refused before session 62)
            d2 = torch.diff(h, 2, 2)  # n and dim by position: dim was read as 2nd, run locally (silently wrong)
            h = h + F.pad(d1, (0, 0, 1, 0)) + F.pad(d2, (0, 0, 1, 1)) + F.pad(torch.diff(h, 1, 3), (0, 1))
        elif k == "gradient_rows":  # torch.gradient along the sharded rows and the columns (refused before session 62)
            gy, gx = torch.gradient(h, dim=(2, 3), spacing=(0.5, 2.0))
            h = h + gy * gx + torch.gradient(h * h, dim=2)[0] + torch.gradient(h, dim=2, edge_order=2)[0]
            if getattr(self, "rows", None):  # coordinates of the whole sample's rows as spacing
                h = h + torch.gradient(h, spacing=(torch.linspace(0, 1, self.rows, dtype=h.dtype) ** 2,), dim=2)[0]
        elif k == "meshgrid":  # coordinate channels (CoordConv, a neural operator's grid; refused before session 62)
            ys = torch.linspace(-1, 1, h.shape[2], dtype=h.dtype)
            xs = torch.linspace(-1, 1, h.shape[3], dtype=h.dtype)
            gy, gx = torch.meshgrid(ys, xs, indexing="ij")
            gx2, gy2 = torch.meshgrid(xs, ys, indexing="xy")
            h = h + gy + 2 * gx + h * gy2 * gx2
        elif k == "table_rows":  # a whole table indexed by the slab's global row positions
            rows = torch.arange(h.shape[2])
            dist = (rows.unsqueeze(-1) * 3 + 2.0).long() % 5  # (H, 1), a slab
            h = h + self.table[dist[:, 0]].t()[None, :, :, None] + self.table[..., rows % 4][:1].t()[None, :1, :, None]
            h = h * F.embedding(rows.unsqueeze(0) % 5, self.table).permute(0, 2, 1).unsqueeze(-1).tanh()
        elif k == "table_freq":  # gradients scaled by index counts, which a slab counts on its own rows
            rows = torch.arange(h.shape[2])
            h = h + F.embedding(rows % 5, self.table, scale_grad_by_freq=True).t()[None, :, :, None]
        elif k == "table_mask":  # a mask of the slab's rows selects rows of a table: not a slab of anything
            rows = torch.arange(h.shape[2])
            h = h + self.table[rows % 5 > 1].sum()
        elif k == "tolist":
            h = h * h.mean(1).sum(0).tolist()[0][0]
        elif k == "nan_reductions":  # NaN-skipping sums and means over the sharded rows
            peak = h.detach() == h.detach().amax((2, 3), keepdim=True)  # one infinity per channel
            inf = torch.where(peak, torch.full_like(h, float("inf")), h)
            nan = torch.where(h.detach() > 0.5, torch.full_like(h, float("nan")), h)
            # nansum keeps an infinity (a finite sum before session 62: nan_to_num clipped it)
            h = h * (1 + torch.isinf(torch.nansum(inf, (2, 3), keepdim=True)).to(h.dtype))
            h = h + torch.nanmean(nan, (2, 3), keepdim=True) + nan.nanmean()  # (refused before session 62)
        elif k == "view_as_slab":  # rows flattened, then back by another slab's shape
            flat = h.reshape(h.shape[0], h.shape[1], -1)
            h = flat.softmax(-1).view_as(h) * 10 + (flat * 2).reshape_as(h)  # (the output unfollowed before session 62)
        elif k == "nan_check":  # a routine NaN check in a forward: any/all over the sharded rows
            if torch.isnan(h).any() or not torch.isfinite(h).all(dim=2).all():
                h = h * 0
            h = h * (1 + torch.count_nonzero(h > 0.5, dim=(2, 3)).to(h.dtype)[:, :, None, None] / 100)
            h = h + (h > 1).any(2, keepdim=True).to(h.dtype) - torch.all(h > -1, dim=-2, keepdim=True).to(h.dtype)
        elif k == "columns_after_rows":  # reductions of what a reduction over the rows leaves
            cols = h.mean(2)  # (N, C, W): on a 2x2 mesh still sharded along W by the second axis
            h = h * cols.sum(-1)[:, :, None, None] + torch.softmax(cols, -1).unsqueeze(2) + cols.amax()
            h = h + cols.cumsum(-1).unsqueeze(2) / 10 + cols.std(-1, keepdim=True).unsqueeze(-1)
            h = h + torch.logsumexp(h.amax(2), -1)[:, :, None, None] + h.sum(2).argmax(-1)[:, :, None, None] / 10
        elif k == "peak_positions":  # where the peaks are: global indices along and over the rows
            h = h + h.argmax(dim=2, keepdim=True).to(h.dtype) / 10 - h.argmin(2).unsqueeze(2).to(h.dtype) / 20
            h = h + h.round().argmax().to(h.dtype) / 100 + torch.argmin(h.round().sum(1)).to(h.dtype) / 1000
        elif k == "max_along_rows":  # (values, indices): the values' gradient to the one element
            top, where = h.max(dim=2, keepdim=True)
            low = torch.min(h.round(), -2).values
            lo, hi = torch.aminmax(h, dim=2, keepdim=True)
            h = h * top + where.to(h.dtype) / 10 + low.unsqueeze(2) + (hi - lo) * h.aminmax().max
        elif k == "similarity_maps":  # feature similarity, distances (unknown calls, refused before session 63)
            proto = torch.tensor([1.0, -2.0, 0.5, 0.3], dtype=h.dtype).view(1, 4, 1, 1)
            h = h * F.cosine_similarity(h, proto, dim=1).unsqueeze(1)  # along channels: local
            h = h + F.cosine_similarity(h, h * h + 0.1, -2, 1e-6).unsqueeze(2)  # along the sharded rows
            rows_last = h.transpose(2, 3)  # the sharded rows as the last dim, which pairwise_distance reduces
            h = h + F.pairwise_distance(rows_last, rows_last * 0.5 + 1, p=1, keepdim=True).transpose(2, 3) / 10
            h = h + F.pairwise_distance(h, h.flip(1)).unsqueeze(-1) / 10 + torch.dist(h, h * 0.3) / 100
        elif k == "one_hot_labels":  # a segmentation loss's one-hot targets of a label slab
            labels = h.argmax(1)
            h = h * F.one_hot(labels, num_classes=4).permute(0, 3, 1, 2).to(h.dtype)
            # without num_classes: the largest label of the whole sample (each slab's before)
            # label 2 or 3 on the last row only
            last = (torch.arange(h.shape[2]) == h.shape[2] - 1).long().view(1, -1, 1)
            onehot = F.one_hot((h.sum(1) > 0.8).long() + 2 * last).permute(0, 3, 1, 2).to(h.dtype)
            h = h * onehot.shape[1] / 4 + onehot[:, 1:2] - onehot[:, 2:].sum(1, keepdim=True)
        elif k == "pick_positions":  # sensor readings at given rows and columns (refused before session 63)
            iy, ix = torch.tensor([0, 6, 3, -1]), torch.tensor([1, 4, 0, 2])
            h = h + h[:, :, iy, ix].sum(-1)[:, :, None, None] / 10  # each position from its owner
            h = h * h[:, :, [0, -2]].mean(2, keepdim=True)  # rows by a list (a 2x2 mesh: still sharded along W)
            h = h + h.index_select(2, torch.tensor([5, 1, 1])).amax(2, keepdim=True)
            h = h + h[torch.tensor([1, 0]), :, torch.tensor([5, 2])].sum(0)[None, :, None, :]  # index dims first
        elif k == "unfold_windows":  # patches and sliding windows along the sharded rows (refused before session 63)
            n = h.shape[2] - h.shape[2] % 2
            pairs = h[:, :, :n].unfold(2, 2, 2)  # (N, C, n / 2, W, 2): the rows in pairs
            h = h + F.pad(pairs.mean(-1).repeat_interleave(2, 2), (0, 0, 0, h.shape[2] - n))
            h = h + F.pad(h.unfold(2, 3, 1).amax(-1), (0, 0, 1, 1))  # overlapping: rows from the next slab
            h = h * h.unfold(3, 2, 1).sum(-1).mean(-1, keepdim=True)  # along the columns: local
        elif k == "unfold_misaligned":
            h = h + h.unfold(2, 4, 4).sum(-1).repeat_interleave(4, 2)
        elif k == "one_hot_bad_label":  # a label past num_classes on the last row only
            last = (torch.arange(h.shape[2]) == h.shape[2] - 1).long().view(1, -1, 1)
            h = h * F.one_hot(h.argmax(1) + 4 * last, num_classes=4).permute(0, 3, 1, 2).to(h.dtype)
        elif k == "pick_out_of_range":
            h = h + h[:, :, torch.tensor([0, h.shape[2]])].sum(2, keepdim=True)
        else:
            raise AssertionError(k)
        return self.head(h)


EXACT = [
    "interpolate_local_size", "interpolate_scale", "pad", "pad_circular", "pad_parity", "max_pool", "avg_pool",
    "adaptive_pool", "mean", "sum", "amax", "max_all", "roll", "roll_back", "window_partition", "cat_split",
    "crop_noop", "item_of_sum", "fconv_std", "fconv_strided", "fconv_same", "fconv_1x1_strided",
    "std", "std_positional", "var_mean", "grn", "vector_norm_inf", "vector_norm_all", "normalize_rows",
    "attention_tokens", "attention_heads_causal", "attention_pooled_kv", "attention_latent_query",
    "linear_attention", "softmax_tokens", "cat_sharded", "cat_pieces", "split_rows", "size_mean", "size_tokens", "size_numel", "size_tensor",
    "size_scalars", "branch_pad", "branch_truth", "position_grid", "position_rows", "stride_rows", "phase_pairs",
    "whole_domain_operand", "slice_rows", "view_whole_minus_one", "position_offset", "repeat_rows", "cumsum_rows",
    "group_norm_call", "instance_norm_call", "setitem_const", "setitem_positions", "meshgrid", "diff_rows", "gradient_rows", "flip", "table_rows", "nan_check", "nan_reductions", "view_as_slab",
    "peak_positions",
    "max_along_rows", "columns_after_rows", "similarity_maps", "one_hot_labels", "pick_positions", "unfold_windows",
    "view_minus_one_inner",
]  # fmt: skip
REFUSED = {
    "window_partition_batched": "matmul|softmax|layout",
    "matrix_norm": "`linalg_norm`.*matrix norm",
    "unbind_rows": "`unbind`.*every position of sharded dim 2",
    "position_step": "`arange`",
    "stride_rows_misaligned": "step 4 along sharded dim 2 needs every slab to start on a multiple of 4",
    "attention_mask": "scaled_dot_product_attention.*attn_mask",
    "tolist": "reads the values",
    "table_mask": "indexing.*index values differ by rank",
    "table_freq": "`embedding`.*scale_grad_by_freq",
    "view_minus_one_across": "`reshape`.*folds sharded dim 2 into a constant shape .* not the outermost",
    "fconv_transpose": "transposed convolution mixes positions along sharded dim",
    "fconv_local_pad": "computed from a slab's local size",
    "instance_norm_running": "`instance_norm`.*updates running statistics",
    "repeat_tiles": "`repeat`.*tiles a tensor of 2 positions along dim 0 by a number computed from a slab's local size",
    "unfold_misaligned": "`unfold`.*windows every 4 rows along sharded dim 2 need every slab to start at a multiple "
                         "of 4",
}


def _exact(kind: str, domain: int, sizes, shape):
    m = mesh(domain)
    torch.manual_seed(0)
    ref = Hazards(kind).double()
    ref.rows = shape[2]  # the global rows, for "whole_domain_operand"
    x = torch.randn(*shape, dtype=torch.float64)
    model = snn.convert(copy.deepcopy(ref), m, strict=True)
    errs = check_against_reference(ref, x, m, sharded=model, sizes=sizes)
    return max(errs.values())


def _refused(kind: str, domain: int, sizes, shape):
    m = mesh(domain)
    torch.manual_seed(0)
    ref = Hazards(kind).double()
    ref.rows = sum(sizes)  # the global rows, for "whole_domain_operand"
    x = torch.randn(*shape, dtype=torch.float64)
    model = snn.convert(copy.deepcopy(ref), m, strict=True)
    r = m.get_local_rank("domain")
    x_local = x.narrow(2, sum(sizes[:r]), sizes[r]).clone()
    try:
        model(x_local)
    except snn.ShardingError as e:
        return type(e).__name__, str(e)
    return "no error", ""


# Uneven, even-sized slabs (window and pool factors of 2 divide every slab).
_SIZES = {2: (6, 4), 3: (6, 4, 4)}


@pytest.mark.parametrize("domain", [2, 3])
@pytest.mark.parametrize("kind", EXACT)
def test_hazard_is_exact(run, kind, domain):
    sizes = _SIZES[domain]
    errs = run(domain, _exact, kind, domain, sizes, (2 if "window" not in kind else 1, 2, sum(sizes), 6))
    assert max(errs) < 1e-10


@pytest.mark.parametrize("domain", [2, 3])
@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_hazard_is_refused_on_every_rank(run, kind, domain):
    sizes = _SIZES[domain]
    out = run(domain, _refused, kind, domain, sizes, (2, 2, sum(sizes), 6))
    assert len(set(out)) == 1, out  # the same error on every rank
    name, msg = out[0]
    assert name == "ShardingError", out[0]
    import re

    assert re.search(REFUSED[kind], msg), msg
    assert "module '<root>' (Hazards)" in msg and "test_forward_calls.py" in msg, msg


def _size_values_2d(kind: str):
    m = mesh((2, 2))
    torch.manual_seed(0)
    ref = Hazards(kind).double()
    x = torch.randn(2, 2, 7, 5, dtype=torch.float64)  # uneven slabs along H and W
    model = snn.convert(copy.deepcopy(ref), m, strict=True)
    return max(check_against_reference(ref, x, m, sharded=model).values())


@pytest.mark.parametrize(
    "kind", ["size_mean", "size_numel", "size_tensor", "size_scalars", "branch_truth", "position_rows",
             "position_offset", "repeat_rows", "cumsum_rows", "group_norm_call", "peak_positions", "max_along_rows",
             "nan_check", "columns_after_rows", "setitem_const", "setitem_positions", "meshgrid", "diff_rows", "flip",
             "gradient_rows", "similarity_maps", "one_hot_labels", "pick_positions", "unfold_windows", "cat_pieces", "split_rows"]
)
def test_sizes_branches_and_row_grids_on_a_2d_mesh(run, kind):
    # A number or branch computed from sizes of both sharded dims (h * w) is the global one; a
    # row grid (sharded by the first axis only) broadcasts against the full slab.
    assert max(run(4, _size_values_2d, kind)) < 1e-10


def _torch_error(domain, kind):
    m = mesh(domain)
    torch.manual_seed(0)
    model = snn.convert(Hazards(kind).double(), m)
    try:
        model(snn.shard(torch.randn(2, 2, 7, 6, dtype=torch.float64), m))
    except (IndexError, RuntimeError) as e:
        return type(e).__name__, str(e)
    return "no error"


@pytest.mark.parametrize("domain", [2, 3])
def test_picked_position_out_of_range_raises_on_every_rank(run, domain):
    # Row 7 of 7 rows: torch's IndexError on every rank (checked against the global length; the
    # slabs' own lengths would raise on some ranks only).
    out = run(domain, _torch_error, domain, "pick_out_of_range")
    assert len(set(out)) == 1 and "index 7 is out of bounds for dimension 2 with size 7" in out[0][1], out


@pytest.mark.parametrize("domain", [2, 3])
def test_one_hot_label_out_of_range_raises_on_every_rank(run, domain):
    # A label of 4 (num_classes=4) on the last row only: torch's error on the last rank alone
    # would leave the others waiting in the model's next collective; every rank raises it.
    out = run(domain, _torch_error, domain, "one_hot_bad_label")
    assert len(set(out)) == 1 and out[0][0] == "RuntimeError" and "num_classes" in out[0][1], out


@pytest.mark.parametrize("domain", [2, 3])
def test_sizes_that_differ_raise_torchs_error_on_every_rank(run, domain):
    # 6 rows against 5 of 7: torch's size error. The slabs' sizes differ on some ranks only
    # (4 + 2 against 4 + 1 rows at P=2): those ranks raised while the others went on to the next
    # collective, a hang; now every rank compares the layouts and raises.
    out = run(domain, _torch_error, domain, "crop_sizes_differ")
    assert len(set(out)) == 1 and out[0][0] == "RuntimeError", out
    assert "size of tensor a (6) must match the size of tensor b (5) at non-singleton dimension 2" in out[0][1], out


class _FloatLeft(nn.Module):
    """Sizes of the sharded rows with a float on their left (local numbers Python computes
    where the guard cannot see) and the forms that stay exact."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)

    def forward(self, x):
        h = self.conv(x)
        n, c, rows, cols = h.shape
        k = 2 * math.pi / rows  # flagged
        h = h * (0.5 * h.shape[2]) + k  # flagged
        h = h + 1.0 / c + rows * 0.01 + 0.5 * (rows / 2) + 2 * math.pi / float(rows)  # exact forms
        h = h * (1 + 0.1 * h.shape[1]) + 0.5 * h.size(-3)  # unsharded sizes: whole (session 64)
        count = h.numel()
        return h * (1.0 / count) + h / h.numel()  # flagged, exact


def _float_left(domain):
    import warnings

    m = mesh(domain)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        snn.convert(_FloatLeft().double(), m)(snn.shard(torch.randn(2, 2, 8, 4, dtype=torch.float64), m))
    return sorted({str(w.message).split(": a float")[0].rsplit(":", 1)[1] for w in caught
                   if "a float on the left of a size" in str(w.message)})


def test_float_on_the_left_of_a_sharded_size_warns(run):
    # ``0.5 * h`` is Python's float arithmetic on the slab's own size: the guard cannot change
    # it, so it reads the model's code once per site and names the line (silent before session 63).
    first = _FloatLeft.forward.__code__.co_firstlineno
    for lines in run(2, _float_left, 2):
        assert lines == [str(first + 3), str(first + 4), str(first + 8)], (lines, first)


def _row_grid_misaligned_2d():
    m = mesh((2, 2))

    class RowGrid(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 4, 3, padding=1)

        def forward(self, x):
            h = self.conv(x)
            rows = torch.arange(h.shape[2], dtype=h.dtype).view(1, 1, -1, 1)  # sharded by axis 0 only
            return h + rows * torch.ones(1, 1, 1, 3, dtype=h.dtype)  # whole along W: not W's slab

    model = snn.convert(RowGrid().double(), m)
    x = torch.randn(1, 2, 5, 6, dtype=torch.float64)  # W = 6: a local width of 3 on every rank
    try:
        model(snn.shard(x, m, dims=(2, 3)))
    except snn.ShardingError as e:
        return str(e)
    return "no error"


def test_row_grid_whole_along_the_other_sharded_dim_is_refused(run):
    out = run(4, _row_grid_misaligned_2d)
    assert all("`add`" in o and "is not sharded along dim 3" in o for o in out), out


def _size_value_of_lost_layout(domain):
    m = mesh(domain)

    class Lost(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 4, 3, padding=1)

        def forward(self, x):
            h = self.conv(x)
            # Half the channels merged with the sharded rows and the rest split off: no layout
            # the guard follows (a flatten of everything is followed since session 54: a fold).
            u = h.reshape(1, 2, 2 * h.shape[2] * h.shape[3])
            return h / u.numel()

    model = snn.convert(Lost().double(), m)
    x = torch.randn(1, 2, 6, 6, dtype=torch.float64)
    try:
        model(x[snn.local_slices(x.shape, m, dims=(2,))])
    except snn.ShardingError as e:
        return str(e)
    return "no error"


def test_size_value_of_a_lost_layout_is_refused(run):
    out = run(2, _size_value_of_lost_layout, 2)
    assert out[0] == out[1] and "whose layout the guard lost" in out[0], out


# --------------------------------------------------------------------------------------------
# The guard's own contract


def _guard_off(domain):
    m = mesh(domain)
    torch.manual_seed(0)
    ref = Hazards("mean").double()
    x = torch.randn(2, 2, 10, 6, dtype=torch.float64)
    model = snn.convert(copy.deepcopy(ref), m, strict=True, guard=False)
    with torch.no_grad():
        y = snn.gather(model(snn.shard(x, m)), m)
    return (y - ref(x)).abs().max().item(), guard_active()


def test_guard_false_runs_unchecked(run):
    # The opt-out really is unchecked: the per-slab mean is wrong (documented).
    out = run(2, _guard_off, 2)
    assert all(e > 1e-6 and not active for e, active in out), out


class Reviewed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Hazards("matrix_norm")  # (refused where checked; "flip" until session 62 routed it)

    def forward(self, x):
        return self.inner(x)


def _reviewed(domain):
    m = mesh(domain)
    model = snn.convert(Reviewed().double(), m, plan={"inner": None})
    x = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    model(snn.shard(x, m))  # reviewed by the user: unchecked, no error
    return True


def test_plan_none_marks_module_reviewed(run):
    assert all(run(2, _reviewed, 2))


def _ambiguous(domain):
    class Up(nn.Module):
        def forward(self, x):
            return F.interpolate(x, size=(8, 4))  # a constant size: global, or equal to local?

    m = mesh(domain)
    model = snn.convert(Up(), m)
    x = torch.randn(1, 1, 8, 4, dtype=torch.float64)
    try:
        model(snn.shard(x, m))
    except snn.ShardingError as e:
        return str(e)
    return "no error"


def test_interpolate_ambiguous_size_is_refused(run):
    out = run(2, _ambiguous, 2)
    assert len(set(out)) == 1 and "could be a global size or this slab's local size" in out[0], out


def _twice_and_copied(domain):
    m = mesh(domain)
    model = snn.convert(Reviewed().double(), m)
    model = snn.convert(model, m)  # converting twice installs the guard once
    hooks = (len(model._forward_pre_hooks), len(model._forward_hooks))
    copied = copy.deepcopy(model)  # a deep copy keeps a working guard, with its own module names
    x = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    try:
        copied(snn.shard(x, m))
    except snn.ShardingError as e:
        return hooks, str(e)
    return hooks, "no error"


def test_guard_installed_once_and_survives_deepcopy(run):
    out = run(2, _twice_and_copied, 2)
    assert len(set(out)) == 1, out
    hooks, msg = out[0]
    assert hooks == (1, 1), hooks
    assert "`linalg_norm` in module 'inner' (Hazards)" in msg, msg


# --------------------------------------------------------------------------------------------
# The sharded layers' input check (run from the layer's own call, not from module hooks)


class LayerMisuse(nn.Module):
    """Hands a sharded 3x3 convolution a tensor it must refuse, chosen by ``kind`` (a transposed
    one for ``other_dim``: since session 54 a convolution given a slab along another spatial dim
    runs as a twin sharding that dim, ``tests/test_layer_other_dims.py``; a transposed one not)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.stem = nn.Conv2d(2, 2, 3, padding=1)
        self.conv = nn.ConvTranspose2d(2, 2, 3, padding=1) if kind == "other_dim" else nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        if self.kind == "replicated":
            h = torch.zeros(1, 2, 4, 4, dtype=x.dtype)  # made here: the same whole tensor on every rank
        elif self.kind == "other_dim":
            h = h.transpose(2, 3)  # now sharded along W, but the conv shards H
        return self.conv(h)


def _misuse(domain, kind):
    m = mesh(domain)
    torch.manual_seed(0)
    model = snn.convert(LayerMisuse(kind).double(), m)
    x = torch.randn(1, 2, 3 * domain + 1, 6, dtype=torch.float64)
    xs = snn.shard(x, m)
    try:
        model(xs)
    except snn.ShardingError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("domain", [2, 3])
@pytest.mark.parametrize(
    "kind, expected",
    [("replicated", "the sharded layer received a replicated (non-slab) tensor"),
     ("other_dim", "shards dims (2,) but its input is sharded along dim 3")],
)
def test_sharded_layer_refuses_a_wrong_input_layout(run, kind, expected, domain):
    out = run(domain, _misuse, domain, kind)
    assert len(set(out)) == 1, out  # the same error on every rank
    layer = "ShardedConvTranspose2d" if kind == "other_dim" else "ShardedConv2d"
    assert expected in out[0] and f"module 'conv' ({layer})" in out[0], out[0]


def _layer_alone_and_guard_removed(domain):
    m = mesh(domain)
    torch.manual_seed(0)
    ref = LayerMisuse("other_dim").double()
    model = snn.convert(copy.deepcopy(ref), m)
    x = torch.randn(1, 2, 4 * domain, 4 * domain, dtype=torch.float64)
    xs = snn.shard(x, m)
    # The model's own layer called outside the model's forward: no guarded forward, no check
    # (sharded along H as the layer expects, it is exact).
    alone = (snn.gather(model.conv(xs), m) - ref.conv(x)).abs().max().item()
    # Converting again without the guard takes its bookkeeping off every layer.
    model = snn.convert(model, m, guard=False)
    left = [n for n, mod in model.named_modules() if "_snn_guard_call" in mod.__dict__]
    model(xs)  # unchecked now: the transposed slab reaches the conv without an error
    return alone, left, guard_active()


def test_layer_check_only_inside_a_guarded_forward(run):
    for alone, left, active in run(2, _layer_alone_and_guard_removed, 2):
        assert alone < 1e-12 and left == [] and not active, (alone, left, active)


class Pooled(nn.Module):
    """A head that pools its encoder's output in its own forward (a guard-routed mean)."""

    def __init__(self, enc: nn.Module) -> None:
        super().__init__()
        self.enc = enc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.enc(x).mean((2, 3))


def _shared_layer(domain):
    m = mesh(domain)
    torch.manual_seed(0)
    ref = Pooled(nn.Conv2d(2, 3, 3, padding=1)).double()
    a = snn.convert(copy.deepcopy(ref), m)
    b = snn.convert(Pooled(a.enc), m)  # the same sharded conv in a second guarded model
    shared = b.enc is a.enc
    a = snn.convert(a, m, guard=False)  # the first model drops its guard; the second keeps it
    x = torch.randn(1, 2, 3 * domain + 1, 5, dtype=torch.float64)
    with torch.no_grad():
        err = (b(snn.shard(x, m)) - ref(x)).abs().max().item()
    return shared, err


def test_layer_shared_by_two_models_keeps_its_guard_work(run):
    # The second model's mean must still be routed (exact): its encoder's output is a slab.
    for shared, err in run(2, _shared_layer, 2):
        assert shared and err < 1e-12, (shared, err)


# --------------------------------------------------------------------------------------------
# timm's weight-standardised convolutions (NFNets, BiT ResNets): F.conv2d of weights computed in
# their own forward, routed to the sharded convolution of those weights


def _std_convs(domain: int, sizes):
    from timm.layers import ScaledStdConv2d, StdConv2d

    m = mesh(domain)
    torch.manual_seed(0)
    ref = nn.Sequential(
        ScaledStdConv2d(2, 6, 3, stride=2, padding=1), nn.GELU(), StdConv2d(6, 4, 3, padding=1, dilation=1),
        nn.ReLU(), ScaledStdConv2d(4, 3, 5, padding=2, groups=1),
    ).double()
    x = torch.randn(2, 2, sum(sizes), 10, dtype=torch.float64)
    model = snn.convert(copy.deepcopy(ref), m, strict=True)
    errs = check_against_reference(ref, x, m, sharded=model, sizes=sizes)
    return max(errs.values())


@pytest.mark.parametrize("domain", [2, 3])
def test_timm_weight_standardised_convs_are_exact(run, domain):
    sizes = _SIZES[domain]
    assert max(run(domain, _std_convs, domain, sizes)) < 1e-10


def _check_classifier(ref, model, m, x, sizes):
    """A timm classifier on uneven H slabs against the single-device one: the replicated logits,
    the input gradient and the parameter gradients (summed over the domain), float64."""
    from .reference import reduce_param_grads

    x = x.detach().requires_grad_()
    y = ref(x)
    g = torch.randn(y.shape, dtype=torch.float64)
    (y * g).sum().backward()
    r = m.get_local_rank("domain")
    x_local = x.detach().narrow(2, sum(sizes[:r]), sizes[r]).clone().requires_grad_()
    y_local = model(x_local)  # logits: replicated
    torch.testing.assert_close(y_local, y.detach(), atol=1e-10, rtol=1e-10)
    snn.losses.share((y_local * g).sum(), m).backward()
    torch.testing.assert_close(snn.gather(x_local.grad, m), x.grad, atol=1e-10, rtol=1e-10)
    grads = reduce_param_grads(model, m)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-10, rtol=1e-10, msg=lambda s, n=name: f"{n}: {s}")
    return True


def _convnext_v2(domain, sizes, conv_mlp):
    # ConvNeXt-V2: the global response norm takes an L2 norm over H and W inside each block's MLP
    # (channels-last, or channels-first with conv_mlp); the guard routes it to reductions.norm.
    timm = pytest.importorskip("timm")
    from timm.models.convnext import ConvNeXt

    m = mesh(domain)
    torch.manual_seed(0)
    ref = ConvNeXt(in_chans=2, num_classes=3, depths=(1, 1, 1, 1), dims=(8, 8, 12, 16), patch_size=2, use_grn=True,
                   ls_init_value=None, conv_mlp=conv_mlp).double()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "grn" in name:
                p.copy_(torch.randn_like(p))  # timm initialises them to zero (identity)
    assert any(type(mod).__name__ == "GlobalResponseNorm" for mod in ref.modules())
    # Without the guard nothing computes the norm over the slabs: strict convert reports it.
    with pytest.raises(snn.ShardingNotImplementedError, match="GlobalResponseNorm"):
        snn.convert(copy.deepcopy(ref), m, strict=True, guard=False)
    model = snn.convert(copy.deepcopy(ref), m, strict=True)
    x = torch.randn(2, 2, sum(sizes), 32, dtype=torch.float64, requires_grad=True)
    return _check_classifier(ref, model, m, x, sizes)


@pytest.mark.parametrize("conv_mlp", [False, True])
@pytest.mark.parametrize("domain", [2, 3])
def test_timm_convnext_v2_global_response_norm_is_exact(run, domain, conv_mlp):
    sizes = {2: (64, 32), 3: (64, 32, 32)}[domain]  # multiples of the total stride (32)
    assert all(run(domain, _convnext_v2, domain, sizes, conv_mlp))


def _pvt_v2(domain, sizes, linear, attn_drop):
    # PVT-v2: every stage's attention takes its queries from the sharded tokens and its keys and
    # values from a strided convolution (or, linear=True, a 7x7 adaptive pool) of them, through
    # F.scaled_dot_product_attention: the guard routes it to ring attention.
    pytest.importorskip("timm")
    import torch.distributed as dist
    from timm.models.pvt_v2 import PyramidVisionTransformerV2

    m = mesh(domain)
    torch.manual_seed(0)
    ref = PyramidVisionTransformerV2(
        in_chans=2, num_classes=3, depths=(1, 1, 1, 1), embed_dims=(8, 8, 16, 16), num_heads=(1, 2, 2, 2),
        mlp_ratios=(2, 2, 2, 2), sr_ratios=(4, 2, 2, 1), linear=linear, attn_drop_rate=attn_drop,
    ).double()
    model = snn.convert(copy.deepcopy(ref), m, strict=True)
    x = torch.randn(2, 2, sum(sizes), 32, dtype=torch.float64, requires_grad=True)
    r = m.get_local_rank("domain")
    x_local = x.detach().narrow(2, sum(sizes[:r]), sizes[r]).clone().requires_grad_()
    if attn_drop:
        # Training with attention dropout: one mask law on every rank (the same seed), so the
        # logits stay replicated; a different draw than the single-device model's, so compare
        # only that it differs from the dropout-free output and that every rank agrees.
        y_local = model(x_local)
        rows = [torch.empty_like(y_local) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, y_local.detach().contiguous())
        assert all(torch.equal(rows[0], t) for t in rows), "ranks disagree on the logits"
        with torch.no_grad():
            assert not torch.allclose(y_local, model.eval()(x_local)), "attention dropout had no effect"
        snn.losses.share(y_local.sum(), m).backward()
        assert torch.isfinite(x_local.grad).all()
        return True
    return _check_classifier(ref, model, m, x, sizes)


@pytest.mark.parametrize("linear", [False, True])
@pytest.mark.parametrize("domain", [2, 3])
def test_timm_pvt_v2_attention_over_sharded_tokens_is_exact(run, domain, linear):
    sizes = {2: (64, 32), 3: (64, 32, 32)}[domain]  # multiples of the total stride (32)
    assert all(run(domain, _pvt_v2, domain, sizes, linear, 0.0))


def test_timm_pvt_v2_attention_dropout_in_training(run):
    assert all(run(2, _pvt_v2, 2, (64, 32), False, 0.3))


def _entry_methods(domain, sizes):
    # timm's other entry points on the converted root: forward_features, forward_intermediates
    # (dense features for segmentation heads), forward_head, and forward called directly. Before
    # session 35 they ran without the guard: ConvNeXt-V2's global response norm over each slab
    # alone, silently.
    pytest.importorskip("timm")
    import torch.distributed as dist
    from timm.models.convnext import ConvNeXt

    m = mesh(domain)
    torch.manual_seed(0)
    ref = ConvNeXt(in_chans=2, num_classes=3, depths=(1, 1, 1, 1), dims=(8, 8, 12, 16), patch_size=2, use_grn=True,
                   ls_init_value=None).double()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "grn" in name:
                p.copy_(torch.randn_like(p))
    model = snn.convert(copy.deepcopy(ref), m, strict=True)
    r = m.get_local_rank("domain")
    x = torch.randn(2, 2, sum(sizes), 32, dtype=torch.float64)
    xl = x.narrow(2, sum(sizes[:r]), sizes[r]).clone().requires_grad_()
    xr = x.clone().requires_grad_()
    feats = model.forward_features(xl)
    feats_ref = ref.forward_features(xr)
    w = torch.randn(feats_ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    rows = feats_ref.shape[2] * sizes[r] // sum(sizes)  # the total stride divides every slab
    start = feats_ref.shape[2] * sum(sizes[:r]) // sum(sizes)
    (feats * w.narrow(2, start, rows)).sum().backward()
    (feats_ref * w).sum().backward()
    errs = [(snn.gather(feats.detach(), m) - feats_ref.detach()).abs().max().item(),
            (xl.grad - xr.grad.narrow(2, sum(sizes[:r]), sizes[r])).abs().max().item()]
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None)  # the head takes no part in forward_features
        if q.grad is not None:
            g = p.grad.clone()
            dist.all_reduce(g)
            errs.append((g - q.grad).abs().max().item())
    with torch.no_grad():
        final, inter = model.forward_intermediates(xl.detach())
        final_ref, inter_ref = ref.forward_intermediates(x)
        errs += [(snn.gather(a, m) - b).abs().max().item() for a, b in zip([final, *inter], [final_ref, *inter_ref])]
        logits = model.forward_head(model.forward_features(xl.detach()))
        errs.append((logits - ref.forward_head(ref.forward_features(x))).abs().max().item())
        errs.append((model.forward(xl.detach()) - ref(x)).abs().max().item())  # forward itself, called directly
    return max(errs)


@pytest.mark.parametrize("domain", [2, 3])
def test_timm_entry_methods_run_under_the_guard(run, domain):
    sizes = {2: (64, 32), 3: (64, 32, 32)}[domain]
    assert max(run(domain, _entry_methods, domain, sizes)) < 1e-10


def _se_entry(domain):
    """timm's forward_features called directly on a converted model with squeeze-excite blocks."""
    import timm

    m = mesh(domain)
    torch.manual_seed(0)
    ref = timm.create_model("mobilenetv3_small_050", num_classes=3).double().eval()
    model = snn.convert(copy.deepcopy(ref), m)
    x = torch.randn(1, 3, 64, 32, dtype=torch.float64)
    with torch.no_grad():
        feats = model.forward_features(snn.shard(x, m, dims=(2,)))
        return (snn.gather(feats, m) - ref.forward_features(x)).abs().max().item()


@pytest.mark.parametrize("domain", [1, 2])
def test_squeeze_excite_entry_methods(run, domain):
    # One rank: the guard installs no entry methods (nothing to guard), and the squeeze-excite
    # block, exact on whole tensors, must not ask for the guard (it raised before session 40).
    assert max(run(domain, _se_entry, domain)) < 1e-10


class PhaseAfterConv(nn.Module):
    """A strided phase between two sharded convolutions (the second agrees on the sliced slab)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1 = nn.Conv2d(2, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return self.c2(self.c1(x)[:, :, 0::2])


def _phase_one_row_slab(domain):
    # Slabs (4, 1): after `0::2` they are (2, 1). The last slab keeps its length, so a layout
    # remembered from before the slice would answer on that rank only, and the ranks hung.
    return max(check_against_reference(PhaseAfterConv().double(), torch.randn(1, 2, 5, 6, dtype=torch.float64),
                                       mesh(domain), sizes=(4, 1)).values())


def test_strided_phase_then_sharded_layer_agrees_again(run):
    assert max(run(2, _phase_one_row_slab, 2)) < 1e-12


@pytest.mark.parametrize("shape,st,request_,local", [
    ((2, 5, 8), (1,), [2, -1, 8], True),  # x.view(b, -1, c): the -1 takes the sharded tokens
    ((1, 5, 8), (1,), [-1, 8], True),  # batch and tokens merged into the -1
    ((2, 3, 4, 2, 2, 6), (1,), [-1, 2, 2, 6], True),  # Swin's windows.view(-1, ws, ws, c)
    ((1, 5, 8), (1,), [1, -1, 8], True),  # a constant 1 takes no dim
    ((1, 12, 8), (1,), [1, 3, 4, -1], False),  # CoaT's reshape(b, h, w, -1): h spans the tokens
    ((1, 8, 6, 5), (2,), [-1, 30], False),  # the sharded rows inside a merged trailing constant
    ((1, 8, 6, 5), (2,), [8, -1], True),  # leading unsharded dims, then the rest
    # 4 splits the leading unsharded dim (8 = 4 x 2: the rest joins the -1, a fold; whole dims
    # only before session 67); 3 factors nothing.
    ((1, 8, 6, 5), (2,), [4, -1], True),
    ((1, 8, 6, 5), (2,), [3, -1], False),
    ((1, 8, 6, 4), (2,), [-1, 2, 2], True),  # a trailing dim split in two (HaloNet's q.reshape(-1, bs, bs, d))
    ((1, 8, 6, 5), (2,), [-1, 3, -1], False),  # two -1: not a local reading
])
def test_minus_one_reading_depends_only_on_unsharded_sizes(shape, st, request_, local):
    from sharded_nn.forward_guard import _minus_one_takes_sharded

    assert _minus_one_takes_sharded(torch.empty(shape), st, request_) is local
    # The sharded dim's local length never changes the decision (every rank decides alike).
    other = list(shape)
    other[st[0]] = 1
    assert _minus_one_takes_sharded(torch.empty(other), st, request_) is local


class _EinopsTokens(nn.Module):
    """A convolution, then einops to tokens and back around a mean over all tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from einops import rearrange

        h, w = x.shape[2:]
        t = rearrange(self.conv(x), "b c h w -> b (h w) c")
        t = t * torch.sigmoid(t.mean(1, keepdim=True))
        return rearrange(t, "b (h w) c -> b c h w", h=h, w=w)


def _einops_warm_cache(domain, sizes, warm):
    from .reference import compare_on_slabs

    m = mesh(domain)
    # einops caches each recipe by shape. A plain call on a tensor shaped like one rank's slab (a
    # model run outside the guard) caches plain ints for that shape: that rank then hits the cache
    # where the others work the recipe out. Before session 50 the guard read the cached plain
    # sizes as the whole sample's (a view to constant sizes: one all-gather on that rank only)
    # and decided einops' own checks on the global sizes (an all-gather on cache misses only):
    # the ranks' collectives no longer paired up.
    torch.manual_seed(0)
    for n in warm:
        _EinopsTokens().double()(torch.randn(2, 3, n, 5, dtype=torch.float64))
    ref = _EinopsTokens().double()
    x = torch.randn(2, 3, sum(sizes), 5, dtype=torch.float64)
    return compare_on_slabs(ref, snn.convert(copy.deepcopy(ref), m), m, x, sizes, replicated=False)


@pytest.mark.parametrize("domain,sizes,warm", [(2, (4, 6), (6,)), (3, (2, 5, 3), (5, 2)), (2, (3, 3), ())])
def test_einops_with_a_warm_recipe_cache(run, domain, sizes, warm):
    assert all(e < 1e-10 for e in run(domain, _einops_warm_cache, domain, sizes, warm, timeout=60))


class TokenBatchNorm(nn.Module):
    """LeViT's ``LinearNorm``: a BatchNorm1d of tokens flattened into the batch dim."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        h = self.conv(x)
        t = h.flatten(2).transpose(1, 2)  # (N, L, C): L sharded
        t = self.bn(t.flatten(0, 1)).reshape_as(t)
        return t.transpose(1, 2).reshape(h.shape)


def _token_batch_norm(domain, sizes, training):
    m = mesh(domain)
    torch.manual_seed(0)
    ref = TokenBatchNorm().double()
    with torch.no_grad():
        ref.bn.running_mean.uniform_(-0.2, 0.2)
        ref.bn.running_var.uniform_(0.5, 1.5)
        ref.bn.weight.uniform_(0.5, 1.5)
    ref.train(training)
    model = snn.convert(copy.deepcopy(ref), m, strict=True)
    # A batch of one: tokens flattened into a batch of several samples interleave the slabs of
    # the samples (a layout the guard does not follow; such a model is refused on every rank).
    x = torch.randn(1, 2, sum(sizes), 5, dtype=torch.float64)
    if not training:
        return max(check_against_reference(ref, x, m, sharded=model, sizes=sizes).values())
    return error_on_slab(model, x, m, sizes)


@pytest.mark.parametrize("domain", [2, 3])
def test_eval_batch_norm_of_flattened_tokens_is_exact(run, domain):
    # Eval mode with running statistics is a per-channel affine map: exact on any layout that
    # keeps the channels whole (was refused: the layer shards dim 2 of (N, C, L) inputs).
    assert max(run(domain, _token_batch_norm, domain, _SIZES[domain], False)) < 1e-12


def test_training_batch_norm_of_flattened_tokens_is_refused(run):
    out = run(2, _token_batch_norm, 2, _SIZES[2], True)
    assert len(set(out)) == 1 and "shards dims (2,) but its input is sharded along dim 0" in out[0], out


class SamePool(nn.Module):
    """timm's ``MaxPool2dSame`` (TF "same" padding: ``max((math.ceil(h / s) - 1) * s + k - h, 0)``
    rows, from the input's size) and the same amount written with ``math.floor`` and ``round``."""

    def __init__(self, k: int) -> None:
        super().__init__()
        from timm.layers import create_pool2d

        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.pool = create_pool2d("max", k, 2, padding="same")
        self.k = k

    def forward(self, x):
        import math

        h = self.conv(x)
        hh = h.shape[2]
        extra = max(round(-math.floor(-hh / 2)) * 2 - hh, 0)  # 1 where the (global) height is odd
        return self.pool(h) + F.pad(h, (0, 0, 0, extra))[:, :, ::2, ::2] * 0.5


def _same_pool(domain, sizes, k):
    m = mesh(domain)
    torch.manual_seed(0)
    ref = SamePool(k).double()
    model = snn.convert(copy.deepcopy(ref), m, strict=True)
    x = torch.randn(1, 2, sum(sizes), 6, dtype=torch.float64)
    if all(s % 2 == 0 for s in sizes[:-1]):
        return max(check_against_reference(ref, x, m, sharded=model, sizes=sizes).values())
    return error_on_slab(model, x, m, sizes)


@pytest.mark.parametrize("sizes,k", [((6, 4), 3), ((6, 5), 3), ((6, 4, 4), 1), ((4, 2, 5), 2)])
def test_tf_same_pads_from_sizes_are_the_global_ones(run, sizes, k):
    # The pad amount is computed from the slab's size through math.ceil and max(.., 0): before
    # session 52 each rank padded by its own slab's amount (a refusal on some ranks, a transport
    # error or a hang on the others); now math.ceil/floor/round keep the guard's tag and max()
    # decides on the global sizes, so every rank pads as one device does.
    assert max(run(len(sizes), _same_pool, len(sizes), sizes, k)) < 1e-12


@pytest.mark.parametrize("sizes,k", [((5, 6), 3), ((4, 3, 4), 1)])
def test_tf_same_pool_of_misaligned_slabs_is_refused_on_every_rank(run, sizes, k):
    out = run(len(sizes), _same_pool, len(sizes), sizes, k)
    assert len(set(out)) == 1 and "needs every slab to start at a multiple of 2" in out[0], out


class GateFromPooled(nn.Module):
    """GhostNet-v3's DFC gate: a pooled branch interpolated back to the tensor's size
    (``size=out.shape[-2:]``) and multiplied in; a UNet-style bilinear skip concatenation."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.short = nn.Conv2d(4, 4, 1)
        self.head = nn.Conv2d(8, 3, 1)

    def forward(self, x):
        h = self.conv(x)
        res = self.short(F.avg_pool2d(h, kernel_size=2, stride=2))  # floors an odd height
        h = h * torch.sigmoid(F.interpolate(res, size=(h.shape[-2], h.shape[-1]), mode="nearest"))
        up = F.interpolate(res, size=h.shape[2:], mode="bilinear", align_corners=False)
        return self.head(torch.cat([h, up], 1))


def _gate_from_pooled(domain, sizes):
    m = mesh(domain)
    torch.manual_seed(0)
    ref = GateFromPooled().double()
    model = snn.convert(copy.deepcopy(ref), m, strict=True)
    x = torch.randn(2, 2, sum(sizes), 5, dtype=torch.float64)
    return max(check_against_reference(ref, x, m, sharded=model, sizes=sizes).values())


@pytest.mark.parametrize("sizes", [(4, 3), (2, 4, 3), (4, 2, 2, 1)])
def test_interpolate_to_a_tensors_size_lines_up_with_it(run, sizes):
    # An odd height pooled by 2 (floored) and interpolated back to the tensor's size: the
    # interpolation lays its rows out by its input's slabs ((5, 2) for (4, 3)), the tensor has
    # its own; before session 52 the product failed on the ranks whose lengths differed and ran on
    # the others (a hang; timm's ghostnetv3 at 224^2). The output now takes the size's layout.
    assert max(run(len(sizes), _gate_from_pooled, len(sizes), sizes)) < 1e-12


class BareSqueeze(nn.Module):
    """``squeeze()`` with no dim at a batch of one: on a slab of one row the sharded dim has
    size 1 too, and torch dropped it on that rank only (one device keeps it, as the other ranks
    did); that rank then went its own way."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        s = y.sum(1, keepdim=True).squeeze()  # (H, W) on one device
        return y * torch.sigmoid(s)


def _bare_squeeze(domain, sizes):
    from .reference import compare_on_slabs

    m = mesh(domain)
    torch.manual_seed(0)
    ref = BareSqueeze().double()
    x = torch.randn(1, 2, sum(sizes), 5, dtype=torch.float64)
    return compare_on_slabs(ref, snn.convert(copy.deepcopy(ref), m), m, x, sizes, replicated=False)


@pytest.mark.parametrize("domain, sizes", [(2, [1, 4]), (3, [3, 1, 2])])
def test_bare_squeeze_keeps_a_slab_of_one_row(run, domain, sizes):
    assert max(run(domain, _bare_squeeze, domain, sizes)) < 1e-10
