-- tensile_db 0.5.0 -> 0.6.0: several devices under one coordinator (tensile.devices): tensile.jobs
-- names each job's device, and tensile.memory has one row per device.
\echo Use "ALTER EXTENSION tensile_db UPDATE TO '0.6.0'" to load this file. \quit

DROP VIEW tensile.jobs;
DROP FUNCTION tensile.job_status();
CREATE FUNCTION tensile.job_status(
    OUT job_id integer, OUT backend_pid integer, OUT role text, OUT model_name text, OUT state text,
    OUT device text, OUT epoch integer, OUT epochs integer, OUT loss double precision,
    OUT device_bytes bigint, OUT peak_device_bytes bigint, OUT vanilla_peak_bytes bigint,
    OUT swapped_out_bytes bigint, OUT swapped_in_bytes bigint, OUT host_bytes bigint, OUT disk_bytes bigint,
    OUT policy text, OUT schedule text, OUT planned_swap_ins bigint, OUT passive_swap_ins bigint,
    OUT recomputes bigint,
    OUT created_at timestamptz, OUT started_at timestamptz)
RETURNS SETOF record
LANGUAGE plpython3u VOLATILE PARALLEL UNSAFE AS $$
if "tensile" not in GD: plpy.execute("SELECT tensile._bootstrap()")
return GD["tensile"].jobs(plpy, GD)
$$;
COMMENT ON FUNCTION tensile.job_status() IS
'Live jobs of every backend, from the coordinator (role, model_name and loss only for jobs of roles the '
'caller is a member of, or for superusers and pg_monitor): the device it runs or waits on (tensile.device, or '
'the one of tensile.devices placement chose), progress, device and swapped bytes, the bytes '
'held in host memory and in the disk tier (its spill file), the scheduler '
'policy, whether the job runs on a plan (schedule: cold start, planned or reactive), and its counts of '
'planned swap-ins, passive (unplanned) swap-ins and recomputes';
CREATE VIEW tensile.jobs AS SELECT * FROM tensile.job_status();
GRANT SELECT ON tensile.jobs TO PUBLIC;
COMMENT ON VIEW tensile.jobs IS
'Live training jobs of every backend: state, device, epoch, loss, device bytes, swapped, host and disk bytes, policy, '
'schedule, planned and passive swap-ins, recomputes';

COMMENT ON FUNCTION tensile.memory_status() IS
'One row per device the coordinator drives (tensile.device, or each of tensile.devices): '
'the device arena: budget, bytes in use, high-water mark since the coordinator started, per-job bytes; '
'and the scheduler: policy, host-to-device and device-to-host bandwidth measured at start (bytes per '
'second), plans made, and the latest plan''s predicted peak bytes and extra seconds per period; '
'and the planned pool: its state (idle, recording, planning, serving, or general only), the bytes its '
'region holds, plans installed, allocations served by lookup, mismatches that sent requests back to the '
'general pool, and for the last recorded period the planned arena, the lower bound (max live bytes) and '
'the highest byte the best-fit general pool touches on the same trace; per_job carries the same three '
'for each job alone; and batch inference on that device: predict calls running or waiting for device memory, the '
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
COMMENT ON VIEW tensile.memory IS
'One row per device: budget, in use, peak, host bytes, fragmentation, per job; the scheduler: policy, '
'bandwidths, plans made, predicted peak and extra time; the planned pool: state, region, lookups, '
'mismatches, planned arena against its lower bound and the general pool; batch inference: running '
'calls, their bytes, the weight cache''s bytes, loads, hits and evictions; compactions and the models '
'open; the coordinator''s resident set; the host budget, host and disk tier bytes, '
'spill files, disk bandwidths, model files and the disk tier''s free bytes';
