"""What the fuzz tests share: the CI subsets' settings, one example's outcome on every rank, and
the long campaigns' loop (``pytest -m slow tests/test_fuzz_*.py``).

``run_campaign`` draws ``n`` examples from a hypothesis strategy and runs each on every rank of a
worker pool (``run(cfg)`` returns the ranks' common outcome: ``"ok"`` or a tuple whose first item
is the kind of non-run, ``"refused"`` by sharded_nn or ``"invalid"`` for the reference library,
and whose last is the reason). It counts outcomes and reasons, prints one example per reason,
writes every mismatch, refusal and timeout to ``$SNN_FUZZ_DUMP`` (JSON) when set, and fails on
any mismatch (a rank raised or compared wrong, or the ranks ended differently) or timeout.
"""

from __future__ import annotations

import collections
import json
import os
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings

from .harness import RankFailure, world_of


def fast_settings(env: str, default: int):
    """The CI subset: ``$env`` (default ``default``) derandomized examples, explicit ones first, no
    shrinking (a failing example restarts the worker pool; it is reported as found)."""
    return settings(max_examples=int(os.environ.get(env, default)), deadline=None, derandomize=True,
                    phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))  # fmt: skip


def slab_of(t, splits, coords):
    """This rank's slab of a whole tensor: ``splits`` holds ``(dim, every rank's length)`` per
    mesh axis, ``coords`` this rank's coordinate on each axis."""
    for (d, split), c in zip(splits, coords):
        t = t.narrow(d, sum(split[:c]), split[c])
    return t


def adaptive_bins(n: int, o: int, a: int, b: int) -> tuple[int, int]:
    """The sharded adaptive pools' layout: of ``o`` bins over ``n`` positions, ``[lo, hi)`` are the
    ones whose start (``floor(i n / o)``) lies in this rank's slab ``[a, b)``."""
    mine = [i for i in range(o) if a <= i * n // o < b]
    return (mine[0], mine[-1] + 1) if mine else (0, 0)


def adaptive_or_replicated(n: int, o: int, a: int, b: int) -> tuple[int, int] | None:
    """``adaptive_bins``, or ``None`` for one bin: a global pool, replicated along that axis."""
    return None if o == 1 else adaptive_bins(n, o, a, b)


def output_blocks(whole, g, splits, coords, rule):
    """This rank's blocks of a whole output and of its gradient weights, and how many ranks hold
    a copy of it. ``rule(n, o, a, b)``: along a sharded dim of ``n`` input positions and ``o``
    outputs, the outputs ``[lo, hi)`` of the rank whose input slab is ``[a, b)``, or ``None``
    where the output is replicated along that axis (then each copy carries ``1 / r`` of the loss
    under the library's gradient convention)."""
    rep = 1
    for (d, split), c in zip(splits, coords):
        got = rule(sum(split), whole.shape[d], sum(split[:c]), sum(split[: c + 1]))
        if got is None:
            rep *= len(split)
            continue
        lo, hi = got
        whole, g = whole.narrow(d, lo, hi - lo), g.narrow(d, lo, hi - lo)
    return whole, g, rep


def randomize_(model, seed: int, scale: float):
    """``model`` with every parameter moved by ``scale`` times a seeded normal draw (so that every
    one matters: zero-initialised biases, tables and layer scales included); returns it."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)
    return model


def randomize_norm_state_(model, statistics: bool = True):
    """``model`` with every parameter moved by a normal draw of 0.3 (norms start at weight 1, bias
    0) and, with ``statistics``, random running statistics (means ~ N(0, 0.25), variances in
    [0.5, 1.5)), from the global generator (seeded by the caller); returns it."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
        if statistics:
            for name, b in model.named_buffers():
                if name.endswith("running_mean"):
                    b.copy_(0.5 * torch.randn_like(b))
                elif name.endswith("running_var"):
                    b.copy_(0.5 + torch.rand_like(b))
    return model


def outcome(pools, case: Callable[[dict], Any], cfg: dict, timeout: float):
    """``case(cfg)`` on every rank of ``cfg["domain"]``'s pool: the ranks' common result (they must
    agree: a refusal on some ranks only would be a hang in a real run)."""
    results = pools.run(world_of(cfg["domain"]), case, cfg, timeout=timeout)
    assert all(x == results[0] for x in results), f"ranks ended differently on {cfg}: {results}"
    return results[0]


def run_campaign(label: str, strategy, run: Callable[[dict], Any], n: int, *, minimum: int = 100,
                 count: Callable[[dict], str] | None = None, every: int = 50) -> collections.Counter:  # fmt: skip
    """Run the campaign; ``count(cfg)``: an extra counter key per example (e.g. its kind)."""
    counts: collections.Counter = collections.Counter()
    mismatches: list[tuple[dict, str]] = []
    others: list[tuple[dict, Any]] = []
    timeouts: list[dict] = []

    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(cfg=strategy)
    def campaign(cfg):
        counts["cases"] += 1
        if count is not None:
            counts[count(cfg)] += 1
        try:
            out = run(cfg)
        except TimeoutError:
            timeouts.append(cfg)
            return
        except (RankFailure, AssertionError) as e:
            cause = e.__cause__ if e.__cause__ is not None else e
            mismatches.append((cfg, str(cause)[-1200:]))
            return
        if out == "ok":
            counts["ok"] += 1
        else:
            counts[out[0]] += 1
            counts[f"{out[0]}: {str(out[-1])[:70]}"] += 1
            others.append((cfg, out))
        if counts["cases"] % every == 0:
            print(f"{label}: {counts['cases']} cases, {len(mismatches)} mismatches", flush=True)

    campaign()
    if os.environ.get("SNN_FUZZ_DUMP"):
        with open(os.environ["SNN_FUZZ_DUMP"], "w") as f:
            json.dump({"mismatches": [{"cfg": c, "why": w} for c, w in mismatches],
                       "not_run": [{"cfg": c, "why": w} for c, w in others], "timeouts": timeouts},
                      f, indent=1, default=str)  # fmt: skip
    print(f"\n{label}: {dict(counts)}; mismatches: {len(mismatches)}; timeouts: {len(timeouts)}")
    for cfg, why in mismatches[:20]:
        print("MISMATCH", cfg, why[-600:])
    seen = set()
    for cfg, out in others:  # one example per reason
        if str(out[-1])[:70] not in seen:
            seen.add(str(out[-1])[:70])
            print("NOT RUN", cfg, out)
    for cfg in timeouts[:20]:
        print("TIMEOUT", cfg)
    assert counts["cases"] >= min(n, minimum)
    assert not mismatches, f"{len(mismatches)} mismatches, first: {mismatches[0]}"
    assert not timeouts, f"{len(timeouts)} cases timed out, first: {timeouts[0]}"
    return counts


def fuzz_tests(label: str, strategy, run: Callable[..., Any], examples: list[dict], *, fast: tuple[str, int],
               campaign: tuple[str, int], count: Callable[[dict], str] | None = None, every: int = 50,
               minimum: int = 100, fast_timeout: float = 300.0):  # fmt: skip
    """A fuzzer's two tests: the CI subset (``fast``: env variable and default number of drawn
    examples, after the fixed ``examples``, each of which must run ``"ok"``) and the long
    campaign (``campaign``: env variable and default; ``pytest -m slow``; at least ``minimum``
    cases). ``run(pools, cfg, timeout)`` returns one example's outcome. Bind the results to
    ``test_*`` names."""

    @fast_settings(*fast)
    @given(cfg=strategy)
    def fast_test(pools, cfg):
        out = run(pools, cfg, fast_timeout)
        if any(cfg is e for e in examples):
            assert out == "ok", out

    for e in reversed(examples):
        fast_test = example(cfg=e)(fast_test)

    @pytest.mark.slow
    def campaign_test(pools):
        timeout = float(os.environ.get("SNN_FUZZ_TIMEOUT", 900))
        run_campaign(label, strategy, lambda cfg: run(pools, cfg, timeout),
                     int(os.environ.get(campaign[0], campaign[1])), count=count, every=every,
                     minimum=minimum)  # fmt: skip

    return fast_test, campaign_test
