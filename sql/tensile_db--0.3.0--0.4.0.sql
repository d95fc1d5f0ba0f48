-- tensile_db 0.3.0 -> 0.4.0: tensile.memory shows the disk tier's free bytes.
\echo Use "ALTER EXTENSION tensile_db UPDATE TO '0.4.0'" to load this file. \quit

-- A new column, disk_free_bytes, last: a new result type.
DROP VIEW tensile.memory;
DROP FUNCTION tensile.memory_status();
CREATE FUNCTION tensile.memory_status(
    OUT device text, OUT budget_bytes bigint, OUT in_use_bytes bigint, OUT peak_bytes bigint,
    OUT host_bytes bigint, OUT free_blocks integer, OUT largest_free_bytes bigint,
    OUT fragmentation double precision, OUT running_jobs integer, OUT queued_jobs integer,
    OUT policy text, OUT h2d_bytes_per_s double precision, OUT d2h_bytes_per_s double precision,
    OUT plans_made integer, OUT predicted_peak_bytes bigint, OUT predicted_extra_s double precision,
    OUT pool text, OUT planned_region_bytes bigint, OUT pool_plans_installed integer,
    OUT planned_allocations bigint, OUT pool_mismatches bigint, OUT planned_arena_bytes bigint,
    OUT max_live_bytes bigint, OUT general_pool_bytes bigint,
    OUT inference_calls integer, OUT inference_bytes bigint, OUT weight_cache_bytes bigint,
    OUT weight_loads bigint, OUT weight_cache_hits bigint, OUT weight_cache_evictions bigint,
    OUT per_job jsonb, OUT started_at timestamptz,
    OUT compactions bigint, OUT compacted_bytes bigint, OUT served_models integer, OUT served_host_bytes bigint,
    OUT rss_bytes bigint, OUT peak_rss_bytes bigint,
    OUT host_budget_bytes bigint, OUT host_used_bytes bigint, OUT host_peak_bytes bigint,
    OUT host_cache_bytes bigint, OUT disk_bytes bigint, OUT spill_file_bytes bigint,
    OUT disk_read_bytes_per_s double precision, OUT disk_write_bytes_per_s double precision,
    OUT served_file_bytes bigint, OUT disk_free_bytes bigint)
RETURNS SETOF record
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE AS $$
if "tensile" not in GD: plpy.execute("SELECT tensile._bootstrap()")
return GD["tensile"].memory(plpy, GD)
$$;
COMMENT ON FUNCTION tensile.memory_status() IS
'The device arena: budget, bytes in use, high-water mark since the coordinator started, per-job bytes; '
'and the scheduler: policy, host-to-device and device-to-host bandwidth measured at start (bytes per '
'second), plans made, and the latest plan''s predicted peak bytes and extra seconds per period; '
'and the planned pool: its state (idle, recording, planning, serving, or general only), the bytes its '
'region holds, plans installed, allocations served by lookup, mismatches that sent requests back to the '
'general pool, and for the last recorded period the planned arena, the lower bound (max live bytes) and '
'the highest byte the best-fit general pool touches on the same trace; per_job carries the same three '
'for each job alone; and batch inference: predict calls running or waiting for device memory, the '
'device bytes they hold, the bytes of model layers kept in the weight cache (counted in in_use_bytes '
'too), layer loads host to device, '
'layer uses served from the cache, and cached layers evicted for room; per_job names models only as '
'tensile.job_status does; and the arena compactions made and the bytes they moved, the model versions '
'open (their layers read from their files) and the host bytes the model store holds (scaling arrays, read '
'buffers in use); and the coordinator process''s resident set and its high-water '
'mark (from /proc), which on a CPU host the device budget does not bound; and the tiers under the '
'device: the host budget (tensile.host_budget), the host bytes in use (swapped-out copies, copies in '
'flight and cached model layers) and their high-water mark, the cached layers'' bytes, the bytes in the '
'disk tier and the extent of the spill files, the spill directory''s read and write bandwidth measured '
'at start (bytes per second), the bytes of the served models'' files, and the bytes free on the spill '
'directory''s file system (tensile.spill_dir) now';
CREATE VIEW tensile.memory AS SELECT * FROM tensile.memory_status();
GRANT SELECT ON tensile.memory TO PUBLIC;
COMMENT ON VIEW tensile.memory IS
'The device: budget, in use, peak, host bytes, fragmentation, per job; the scheduler: policy, '
'bandwidths, plans made, predicted peak and extra time; the planned pool: state, region, lookups, '
'mismatches, planned arena against its lower bound and the general pool; batch inference: running '
'calls, their bytes, the weight cache''s bytes, loads, hits and evictions; compactions and the models '
'open; the coordinator''s resident set; the host budget, host and disk tier bytes, '
'spill files, disk bandwidths, model files and the disk tier''s free bytes';
