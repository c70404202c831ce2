"""A rank's staging region from the runtime config (rank processes only: it imports torch).

GPU ranks (and host ranks with ``staging.onCpu``) allocate one region at start, before the engine
registers memory, so it is registered beside the pools: a prefill rank one ring, a decode rank
``staging.lanes`` rings. A prefill rank with ``staging.enabled`` false still holds the few signal
words (it can tell a decode that granted it a lane that it writes directly); a decode rank then
takes no staged requests. A region that does not fit beside the pools fails the rank at start with
the fields to change (``StagingError``).
"""

from __future__ import annotations

from pdfleet_runtime.config import Role, RuntimeConfig
from pdfleet_runtime.pools import RankPools
from pdfleet_runtime.protocol.staged import DecodeStaging, Layout, PrefillStaging, StagingRegion

__all__ = ["staging_of"]


def staging_of(cfg: RuntimeConfig, pools: RankPools) -> PrefillStaging | DecodeStaging | None:
    st = cfg.staging
    device = str(pools.arena.device)
    if device == "cpu" and not st.on_cpu:
        return None  # host pools keep the direct write
    table = st.table_mib << 20
    if cfg.role is Role.PREFILL:
        lay = Layout(st.slots, st.slot_mib << 20, 1, table) if st.enabled else Layout(1, 256, 1, 256)
        region = StagingRegion(lay, device, extra=PrefillStaging.extra_bytes(), what="prefill staging")
        return PrefillStaging(region, pools.arena, enabled=st.enabled)
    if not st.enabled:
        return None
    region = StagingRegion(Layout(st.slots, st.slot_mib << 20, st.lanes, table), device, what="decode staging")
    return DecodeStaging(region, pools.arena, threshold_bytes=st.threshold_bytes, min_chunks=st.min_chunks,
                         cpu=st.on_cpu)
