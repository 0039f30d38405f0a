"""``begin_many``: requests whose forward runs together, begun as one step.

Their storage hits are fetched as one storage job (``lifecycle.look_many``: one segment per
request, each stopping at its own first missing page), then each request is begun from its
first look, its host hits joining the batch's one layer-wise load (``CopyBatch``), and the
layer waits follow that load. A refused load turns the host parts into misses; anything that
raises releases every request begun so far.
"""

from __future__ import annotations

from tiered_kv.cache import lifecycle
from tiered_kv.cache.request import Request


def begin_many(
    cache, prompts: list[list[int]], extra_keys: list, priors: list[bytes]
) -> list[Request]:
    """Begin ``prompts`` (checked, with one extra key and prior each, and free rows) together
    on ``cache`` (the ``TieredKVCache`` calling, whose lock it holds); see its
    ``begin_many``."""
    manager, planner, policies = cache.manager, cache.load_planner, cache.config.policies
    # The batch's forward follows its merged load only: earlier loads must have landed.
    manager.chain_loads.settle_older()
    looks = lifecycle.look_many(
        manager,
        [t[:-1] for t in prompts],  # the last prompt token is always computed
        priors,
        prompt_tokens=[len(t) for t in prompts],
        prefetch_threshold=policies.prefetch_threshold,
        prefetch_wait=policies.prefetch_wait_s,
        plan=None if planner is None else planner.plan,
    )
    reqs: list[Request] = []
    batch = manager.load_batch
    batch.open()
    try:
        for tokens, key, prior, first in zip(prompts, extra_keys, priors, looks, strict=True):
            reqs.append(cache._begin_one(tokens, key, prior, first))
        if not batch.flush():
            # Refused (a closed worker): as in ``begin``, the host parts become misses.
            manager.poll()
            for i, r in enumerate(reqs):
                if manager.holds_stale(r.node):
                    cache.abort(r)
                    reqs[i] = cache._begin_one(prompts[i], extra_keys[i], priors[i])
    except BaseException:
        try:
            if batch.is_open:
                batch.flush()  # what was set up is submitted (or failed), then released
        finally:
            for r in reqs:
                if not r.finished:
                    cache.abort(r)
        raise
    return _started(cache, reqs)


def begin_uncached(
    cache, prompts: list[list[int]], extra_keys: list, priors: list[bytes]
) -> list[Request]:
    """Begin ``prompts`` with no prefix each (``begin_many(cached=False)``): nothing matched,
    fetched or loaded; on failure the ones begun are aborted."""
    reqs: list[Request] = []
    try:
        for tokens, key, prior in zip(prompts, extra_keys, priors, strict=True):
            reqs.append(cache._begin_one(tokens, key, prior, cached=False))
    except BaseException:
        for r in reqs:
            cache.abort(r)
        raise
    return _started(cache, reqs)


def _started(cache, reqs: list[Request]) -> list[Request]:
    """``reqs``, begun: their hits counted and the layer waits following their loads."""
    for r in reqs:
        cache.metrics.hits.add(r.hits)
    cache._follow(reqs)
    return reqs
