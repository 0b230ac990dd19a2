"""Call -> KernelKey -> launch config: the tuning table's entry for a call's key (or the
autotune fallback's, or the default), shaped for the call by the launch heuristics, and
remembered per key and per call shape.
"""

from __future__ import annotations

import torch

from lik.runtime import autotune
from lik.runtime.heuristics import stream_config
from lik.runtime.keys import (
    KernelKey,
    gpu_card,
    gpu_family,
    lq_bucket,
    padded_head_dim,
    query_bucket,
    size_class,
)
from lik.runtime.tuning import (
    BACKWARD_WARPS,
    STACKED_ROWS,
    committed_source,
    config_for,
    default_config,
    one_warpgroup_backward,
)

_configs: dict[KernelKey, object] = {}  # a key's config, looked up once (config_of_key)


def call_key(name: str, module, Q: torch.Tensor, lq: int, programs: int, kernel: str):
    """The KernelKey of a call of variant `name` (module) with queries Q."""
    queries = query_bucket(Q.shape[0]) if module.LAYOUT == "dense" else 1
    return KernelKey(name, gpu_family(Q.device), padded_head_dim(Q.shape[-1]), lq_bucket(lq),
                     size_class(programs), queries, kernel, gpu_card(Q.device))  # fmt: skip


def config_of_key(name: str, module, Q: torch.Tensor, lq: int, programs: int, kernel: str):
    """The config of a call's tuning key (committed entry, autotuned entry or default),
    looked up once per key."""
    key = call_key(name, module, Q, lq, programs, kernel)
    config = _configs.get(key)
    if config is None:
        entry = autotuned_entry(key, Q.device)
        config = _configs.setdefault(key, config_for(key, module.smem_bytes, entry))
    return config


def autotuned_entry(key: KernelKey, device: torch.device) -> dict | None:
    """A key's autotuned entry, where it has no committed one and autotune applies (a call
    on `device`; lik explain asks as for a CUDA call)."""
    if not autotune.applies(key, device) or committed_source(key) is not None:
        return None
    return autotune.cached_entry(key)


def keyed_config(
    name: str, module, Q: torch.Tensor, lq: int, programs: int, docs: int, doc_tokens: int,
    kernel: str, key_config=None,
):  # fmt: skip
    """The launch config of a call: its tuning key's config (or key_config in its place),
    then, for kernels that stream docs, the doc blocks or token ranges `docs` and
    `doc_tokens` (Nd and Ld) call for, and for docs loaded once the tile and warps of the
    "once" key."""
    config = key_config or config_of_key(name, module, Q, lq, programs, kernel)
    if not getattr(module, "DOC_STREAM", False):  # streaming modules: never a "bwd" key
        return config
    dense_bytes = docs * doc_tokens * Q.shape[-1] * Q.element_size()
    once = lambda: config_of_key(name, module, Q, lq, programs, "once")  # noqa: E731
    return stream_config(module, config, once, Q.shape[0], docs, doc_tokens, dense_bytes, Q.device)


def autotune_call(name: str, module, Q: torch.Tensor, lq: int, programs: int, docs: int,
              doc_tokens: int, kernel: str, run) -> None:  # fmt: skip
    """Sweeps the call's `kernel` key ("fwd" or "bwd"), once, where no table and no
    earlier sweep covers it (lik.runtime.autotune): each candidate entry is shaped into a
    launch config as the call would shape the key's entry, configs that shape alike are
    timed once, and run(config) launches the call with it and returns its output(s)."""
    key = call_key(name, module, Q, lq, programs, kernel)
    if not autotune.applies(key, Q.device) or autotune.capturing(Q.device):
        return
    if committed_source(key) is not None or autotune.cached_entry(key) is not None:
        return
    base = default_config(key)
    backward = kernel == "bwd"
    # Queries stack in forward tiles only; a backward keeps the key's default.
    stackable = base["query_group"] if backward else min(key.queries, 2 * STACKED_ROWS // key.lq)
    # 2 and 8 warps won none of nine plain lowmem backwards (tuning.default_config).
    warps = (BACKWARD_WARPS,) if one_warpgroup_backward(key) else None
    entries, launched = [], {}
    for entry in autotune.candidates(base, lq=key.lq, max_query_group=max(1, stackable),
                                     backward=backward, warps=warps):  # fmt: skip
        key_config = config_for(key, module.smem_bytes, entry)
        config = keyed_config(name, module, Q, lq, programs, docs, doc_tokens, kernel,
                               key_config)  # fmt: skip
        if config not in launched.values():
            entries.append(entry)
            launched[id(entry)] = config
    docs_shape = f", D [{docs}, {doc_tokens}, {Q.shape[-1]}]" if docs else ""
    shape = f"call-time sweep: Q {list(Q.shape)}{docs_shape}, {programs} outputs"
    if autotune.sweep(key, entries, lambda entry: run(launched[id(entry)]), Q.device, shape,
                      graph=backward):  # fmt: skip
        _configs.pop(key, None)  # the key's config is the winner's from now on


# Each call's config by its exact sizes: shapes repeat from call to call, so the hot path
# is one dict hit instead of bucketing and the per-call derivations (a rerank kernel takes
# ~30 us; every microsecond of host work per call shows on small calls). Cleared when
# full, so a stream of distinct shapes cannot grow it without bound.
_call_configs: dict[tuple, object] = {}
CALL_CONFIG_CACHE_SIZE = 4096


def call_config(
    name: str, module, Q: torch.Tensor, lq: int, programs: int, *, docs=0, doc_tokens=0,
    kernel="fwd", run=None,
):  # fmt: skip
    """The launch config of a call (see keyed_config), remembered per call shape.
    kernel: "fwd", or "bwd" for a training variant's backward kernels. run(config) -> its
    output(s), where given, launches the call: a key without an entry is autotuned with it."""
    call = (name, Q.get_device(), Q.shape[0], Q.shape[-1], lq, programs, docs, doc_tokens,
            kernel)  # fmt: skip
    config = _call_configs.get(call)
    if config is None:
        if len(_call_configs) >= CALL_CONFIG_CACHE_SIZE:
            _call_configs.clear()
        if run is not None:
            autotune_call(name, module, Q, lq, programs, docs, doc_tokens, kernel, run)
        config = keyed_config(name, module, Q, lq, programs, docs, doc_tokens, kernel)
        _call_configs[call] = config
    return config
