"""State the sharded dims once (issue 15, item 2): set_layout / init_mesh(dims=..., align=...)."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import sharded_nn as snn

D = torch.float64


def _stated():
    p = torch.distributed.get_world_size()
    plain = snn.init_mesh(domain=p, device_type="cpu")
    assert snn.default_dims(plain) == (2,) and snn.stated_layout(plain) is None
    m = snn.init_mesh(domain=p, device_type="cpu", dims=(3,), align=2)
    assert snn.default_dims(m) == (3,)
    assert snn.stated_layout(m) == snn.mesh.StatedLayout((3,), (2,))
    assert snn.default_dims(plain) == (2,)  # stated per mesh object
    torch.manual_seed(0)
    x = torch.randn(1, 2, 5, 13, dtype=D, requires_grad=True)
    sl = snn.local_slices(x.shape, m)
    assert sl == snn.local_slices(x.shape, m, dims=(3,), align=2)
    assert sl[3].start % 2 == 0 and sl[2] == slice(None)
    x_l = snn.shard(x.detach(), m).requires_grad_()
    assert x_l.equal(x.detach()[sl])
    # convert, gather and the reductions default to the stated dims too.
    ref = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, padding_mode="circular"), nn.GELU(),
                        nn.Conv2d(3, 2, 3, stride=2, padding=1)).to(D)  # fmt: skip
    model = snn.convert(copy.deepcopy(ref), m)
    assert all(layer.dims == (3,) for layer in (model[0], model[2]))
    y_ref = ref(x)
    y = snn.gather(model(x_l), m)
    torch.testing.assert_close(y, y_ref)
    total = snn.reductions.sum(x_l, m, dims=(3,))
    torch.testing.assert_close(total, x.detach().sum(3))
    snn.losses.share((y * y).sum(), m).backward()
    (y_ref * y_ref).sum().backward()
    torch.testing.assert_close(x_l.grad, x.grad[sl])
    # Explicit dims still win; with other dims the stated align does not apply.
    assert snn.local_slices(x.shape, m, dims=(2,))[2] == snn.local_slices(x.shape, plain)[2]
    # A tensor that cannot carry the stated layout raises, the same on every rank.
    try:
        snn.shard(torch.zeros(2, 3, 8), m)
    except snn.ShardingError as e:
        return str(e)
    return None


def test_stated_layout_is_every_default(run):
    for msgs in (run(2, _stated), run(3, _stated)):
        assert msgs[0] is not None and len(set(msgs)) == 1, msgs
        assert "the layout stated for this mesh" in msgs[0] and "shards dims (3,)" in msgs[0]
        assert "shape (2, 3, 8)" in msgs[0]
